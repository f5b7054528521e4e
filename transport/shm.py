"""Weights through shared memory, for engines on the trainer's host: one segment per version
in a tmpfs folder (default under /dev/shm) that the sender packs the buckets into and each
engine maps and loads without a copy of its own.

Segment `<root>/v<version:010d>.seg`:
- a header of `HEADER_BYTES`: the magic `MAGIC`, the format `FORMAT` (uint32), the version
  (int64), the payload bytes (uint64) and the manifest's fingerprint (`Manifest.fingerprint`,
  `FINGERPRINT_BYTES`: the manifest itself comes with the sync plan);
- then the buckets of `Manifest.buckets`, each packed as every transport packs it
  (`transport.base.iter_packed`: tensors in the wire dtype at `bucket_layout`'s offsets),
  one after the other, each starting at a multiple of `manifest.ALIGN`.

The sender reserves the whole segment first (`os.posix_fallocate`: a full tmpfs is a clear
`TransferError`, never a SIGBUS while writing), packs into its mapping (the cast to the wire
dtype and the layout change are that one copy), and renames the file into place: the rename
is the commit, so a receiver never sees part of a version. It keeps the newest `keep`
segments it wrote; once it holds `keep`, the next version goes into the oldest of them when no
engine holds that one any more (`transport.shm_lease`: rewritten in place, its pages already
in RAM, grown or shrunk to the new layout), else into a fresh segment while the oldest is
unlinked (an engine that still maps it keeps its pages until it drops them). `close` unlinks
every segment it wrote.

A receiver maps the committed segment copy-on-write (a loader that writes into what it is
handed gets private pages; the segment stays as the sender wrote it), checks its header
against the manifest it was told to expect (a segment of another version, of another layout,
or shorter than the manifest needs is refused before any bucket is loaded), and hands each
bucket to its callback as views into the mapping; the views keep the mapping alive for as
long as the engine holds them (vLLM's layerwise reload may keep some until it finalizes). It
holds a shared lock on the segment it loaded until it has loaded the next version (or closes),
so the sender never rewrites one under it. A segment truncated by another process while an
engine reads it would end that engine with SIGBUS, as any shared mapping would: nothing but
this sender may write under `root`.

Memory: each kept version is its payload once in RAM (tmpfs), shared by every engine that
maps it; the sender adds no buffer of its own. torch is imported lazily, as in every
transport module. On GPUs the same seam would carry CUDA IPC handles instead of host pages
(not built: no GPU here).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transport.base import (
    BufferPool,
    OnBucket,
    SendStats,
    TransferError,
    iter_packed,
    unpack,
)
from transport.file import FolderReceiver, FolderSender, wait_path
from transport.manifest import (
    ALIGN,
    FINGERPRINT_BYTES,
    Manifest,
    ManifestError,
    bucket_layout,
)
from transport.shm_lease import claim_retired, hold_shared, release

if TYPE_CHECKING:
    import torch

MAGIC = b"JAXRLSHM"
"""The first 8 bytes of every segment."""

FORMAT = 1
"""The segment format this module writes and reads."""

_HEAD = struct.Struct(f"<8sIqQ{FINGERPRINT_BYTES}s")

MADV_POPULATE_READ = 22
"""Linux's madvise advice (5.14+) that maps a range's pages for reading in one call."""

HEADER_BYTES = 4096
"""Bytes before the first bucket (the header, zero-padded to a page)."""


def segment_path(root: str | os.PathLike, version: int) -> Path:
    """The committed segment of `version` under `root`."""
    return Path(root) / f"v{version:010d}.seg"


def bucket_offsets(manifest: Manifest) -> tuple[list[tuple[int, int]], int]:
    """Where each bucket of `manifest` sits in its segment.

    Returns:
        ([(byte offset, bytes)] per bucket of `manifest.buckets()`, the segment's bytes):
        offsets from the segment's start, the first at `HEADER_BYTES`, each aligned to
        `ALIGN`.
    """
    out, off = [], HEADER_BYTES
    for bucket in manifest.buckets():
        total = bucket_layout(manifest, bucket)[1]
        out.append((off, total))
        off += -(-total // ALIGN) * ALIGN
    return out, off


class _SegmentRegions(BufferPool):
    """A pool whose buffers are the buckets' regions of one segment, handed out in bucket
    order (one `get` per bucket, as `iter_packed` asks with one slot)."""

    def __init__(self, segment: torch.Tensor, regions: list[tuple[int, int]]) -> None:
        super().__init__()
        self._segment, self._regions, self._next = segment, regions, 0

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        off, total = self._regions[self._next]
        assert nbytes == total, (nbytes, total)
        self._next += 1
        return self._segment[off : off + total]


class _KeptMap:
    """The sender's read-write shared mapping of one segment of `size` bytes and a uint8
    `[size]` tensor over it, kept while the segment is kept. MAP_POPULATE maps the pages
    fallocate reserved in one go, not one fault per page while packing."""

    def __init__(self, fd: int, size: int) -> None:
        import torch

        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self.size = size
        self.mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        self.segment = torch.frombuffer(self.mm, dtype=torch.uint8)

    def close(self) -> None:
        """Unmap (a view still alive, e.g. in a traceback: the mapping goes with it at gc)."""
        del self.segment
        with contextlib.suppress(BufferError):
            self.mm.close()


class ShmSender(FolderSender):
    """Writes each version as a segment under `root` and commits it by a rename (see
    `FolderSender`; `root` is a folder on a tmpfs, e.g. /dev/shm/jaxrl-RUN, that every engine
    of the local host sees at the same path, and belongs to this run's trainer)."""

    def __init__(self, root: str | os.PathLike, keep: int = 2) -> None:
        super().__init__(root, keep)
        self._written: list[Path] = []
        self._reusing = False
        self.reused = 0  # versions written into a retired segment (`shm_lease`)
        # (st_dev, st_ino) of each kept segment -> its mapping: a rewrite in place packs into
        # the mapping it already has, its page-table entries populated (a fresh mapping of
        # the same file costs MAP_POPULATE's pass over every page, about a memcpy again)
        self._maps: dict[tuple[int, int], _KeptMap] = {}
        self._key_of: dict[Path, tuple[int, int]] = {}

    def _segment_fd(self, tmp: Path) -> int:
        """An open read-write descriptor of the file at `tmp` to write the next version into:
        the oldest segment this sender keeps, when `keep` are kept and no engine holds it
        (`shm_lease.claim_retired`: its pages are reused, no page faults), else a new file."""
        self._reusing = False
        if len(self._written) >= self.keep:
            fd = claim_retired(self._written[0], tmp)
            if fd is not None:
                self._key_of.pop(self._written.pop(0), None)  # its mapping stays, by inode
                self._reusing = True
                return fd
        return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    def send(self, manifest: Manifest, tensors: Iterable[tuple[str, Any]]) -> SendStats:
        """See `WeightSender.send`. Returns once the version's segment is committed.

        Raises:
            ManifestError: a tensor's name or shape differs from the manifest (nothing is
                committed).
            TransferError: the folder has no room for the segment (nothing is written).
        """

        t0 = time.perf_counter()
        regions, size = bucket_offsets(manifest)
        final = segment_path(self.root, manifest.version)
        tmp = self.root / f".tmp-v{manifest.version:010d}-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = self._segment_fd(tmp)
        try:
            try:
                if os.fstat(fd).st_size > size:  # a retired segment of a larger layout
                    os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)  # a fresh or smaller one: reserve it whole
            except OSError as e:
                raise TransferError(
                    f"no room for version {manifest.version} in {self.root}: it needs "
                    f"{size / 2**20:.1f} MiB ({e.strerror})"
                ) from None
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            kept = self._maps.pop(key, None)
            if kept is not None and kept.size != size:  # grown or shrunk: map it again
                kept.close()
                kept = None
            try:
                if kept is None:
                    kept = _KeptMap(fd, size)
                kept.mm[: _HEAD.size] = _HEAD.pack(
                    MAGIC, FORMAT, manifest.version, manifest.total_bytes,
                    manifest.fingerprint(),
                )  # fmt: skip
                pool = _SegmentRegions(kept.segment, regions)
                n = sum(1 for _ in iter_packed(manifest, tensors, "cpu", pool))
                del pool
            except BaseException:
                if kept is not None:
                    kept.close()
                raise
            os.replace(tmp, final)
        finally:
            # Python's mmap holds a dup of `fd`, the same open file: unlock it explicitly,
            # closing `fd` alone would leave a claimed segment's exclusive lock on the kept map
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self._maps[key] = kept
        self._key_of[final] = key
        self.reused += self._reusing
        if final in self._written:
            self._written.remove(final)
        self._written.append(final)
        for old in self._written[: -self.keep]:
            self._unlink(old)
        self._written = self._written[-self.keep :]
        return SendStats(manifest.version, manifest.total_bytes, n, time.perf_counter() - t0)

    def _unlink(self, path: Path) -> None:
        """Unlink a segment this sender wrote and drop its kept mapping (which would
        otherwise keep its pages in RAM after the unlink)."""
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        kept = self._maps.pop(self._key_of.pop(path, (-1, -1)), None)
        if kept is not None:
            kept.close()

    def close(self) -> None:
        """Unlink every segment this sender wrote (engines that map one keep its pages), and
        `root` itself when that leaves it empty."""
        for p in self._written:
            self._unlink(p)
        self._written = []
        for kept in self._maps.values():  # a segment claimed by a send that then failed
            kept.close()
        self._maps, self._key_of = {}, {}
        with contextlib.suppress(OSError):  # not empty, or gone
            self.root.rmdir()


class ShmReceiver(FolderReceiver):
    """Waits for a committed segment under `root` (see `FolderReceiver`; it looks every 10 ms
    by default), checks it, and loads it bucket by bucket from views of its mapping."""

    def __init__(self, root: str | os.PathLike, timeout_s: float = 300.0, poll_s: float = 0.01):
        super().__init__(root, timeout_s, poll_s)
        self._held: int | None = None  # the last loaded segment, its shared lock held

    def receive(self, manifest: Manifest, on_bucket: OnBucket) -> None:
        """See `WeightReceiver.receive`.

        Raises:
            ManifestError: the segment holds another layout (its fingerprint differs).
            TransferError: not committed within `timeout_s`; a segment that is not one
                (magic, format), holds another version, or is shorter than the manifest
                needs (truncated); the callback raised (chained).
        """
        path = segment_path(self.root, manifest.version)
        wait_path(path, self.timeout_s, self.poll_s, f"version {manifest.version}")
        segment, fd = _map(path, manifest)
        regions, _ = bucket_offsets(manifest)
        try:
            for bucket, (off, total) in zip(manifest.buckets(), regions, strict=True):
                try:
                    on_bucket(unpack(manifest, bucket, segment[off : off + total]))
                except Exception as e:
                    raise TransferError(f"loading version {manifest.version} failed: {e!r}") from e
        except BaseException:
            release(fd)
            raise
        # the loader may read the views until its next update (vLLM finalizes after this
        # returns): hold this segment until the next version is loaded, let go the last one
        release(self._held)
        self._held = fd

    def close(self) -> None:
        """Let go of the segment last loaded (the sender may then rewrite it)."""
        release(self._held)
        self._held = None


def _map(path: Path, manifest: Manifest) -> tuple[torch.Tensor, int]:
    """The segment at `path` mapped copy-on-write as uint8 `[bytes]`, its header checked
    against `manifest` (see `ShmReceiver.receive` for what is refused), and its open file
    descriptor holding the shared lock (`shm_lease.hold_shared`: the sender leaves it alone
    until it is closed)."""
    import torch

    _, need = bucket_offsets(manifest)
    v = manifest.version
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:  # unlinked, or taken for rewriting, by a newer version meanwhile
        raise TransferError(f"reading version {v} at {path}: {e}") from e
    try:
        hold_shared(fd)
        size = os.fstat(fd).st_size
        if size < need:
            raise TransferError(f"{path}: truncated: {size} bytes, version {v} needs {need}")
        # no MAP_POPULATE: on a private writable mapping it would copy every page (the
        # kernel breaks copy-on-write when it populates one); MADV_POPULATE_READ maps the
        # segment's own pages read-only in one go instead of one fault per page
        mm = mmap.mmap(fd, need, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        with contextlib.suppress(OSError, ValueError):  # kernels before 5.14: faulted lazily
            mm.madvise(MADV_POPULATE_READ)
        magic, fmt, version, payload, fingerprint = _HEAD.unpack_from(mm, 0)
        if magic != MAGIC or fmt != FORMAT:
            raise TransferError(f"{path}: not a segment of format {FORMAT} ({magic!r}, {fmt})")
        if version != v or payload != manifest.total_bytes:
            raise TransferError(
                f"{path}: a stale segment: it holds version {version} ({payload} bytes), "
                f"expected version {v} ({manifest.total_bytes} bytes)"
            )
        try:
            manifest.check_offered(fingerprint)
        except ManifestError as e:
            raise ManifestError(f"{path}: {e}") from None
    except OSError as e:
        release(fd)
        raise TransferError(f"reading version {v} at {path}: {e}") from e
    except BaseException:
        release(fd)
        raise
    return torch.frombuffer(mm, dtype=torch.uint8), fd
