"""Weights through a shared folder as compressed deltas: for engines far from the trainer (the
pure-JAX seed's "delta weight sync over a filesystem" for inference pools on other sites), a
version travels as its difference from the version before it.

Each bucket is the packed uint8 buffer of the other transports (`transport.base.iter_packed`:
every tensor cast to the manifest dtype, at its aligned offset). A version is either a
**keyframe** (the bucket's bytes, zstd-compressed) or a **delta** against the version the
sender wrote before it: the XOR of the two buffers, so a value the step left unchanged is zero
in every byte (a bf16 update below half an ulp leaves the value unchanged), with the bytes of
each tensor's values regrouped by significance (byte plane 0 of every value, then plane 1, as
Blosc's "shuffle" filter does) before zstd, so that the planes that rarely change compress to
almost nothing. XOR is its own inverse: the receiver XORs the delta into the buffer it holds
and has version v bit for bit; the SHA-256 of every rebuilt bucket is checked against the one
the sender wrote (a mismatch is a `TransferError`, nothing of it is loaded).

Layout under `root`, as `transport.file` (a hidden folder renamed into place commits a
version; the `fingerprint` file is the manifest's `Manifest.fingerprint`), with
``chain.json`` (the version, its `base` version or null for a keyframe, its `keyframe`, each
bucket's SHA-256 and stored size) and one ``bucket_<i:05d>.zst`` per bucket (encoded by
`transport.delta_codec`, shared with the TCP stream per far engine, `transport.delta_stream`).
The sender writes a keyframe first, after every `full_every` - 1 deltas, and whenever the
layout changes; it keeps the newest `keep` versions and every older one they need back to
their keyframe.

Memory: the sender holds the last version's packed bytes (the model's size in the wire dtype);
so does a receiver once it has loaded a version. A receiver that does not hold the base (a
new or restarted engine, or one left out of a push) rebuilds it from the keyframe and the
deltas on disk, one version at a time.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from transport.base import (
    OnBucket,
    SendStats,
    TransferError,
    WeightSender,
    iter_packed,
    unpack,
)
from transport.delta_codec import (
    decode_bucket,
    digest,
    encode_bucket,
    layout_key,
    planes_of,
    shuffle,  # noqa: F401 - part of this module's interface (tests, older callers)
    unshuffle,  # noqa: F401
)
from transport.file import (
    FINGERPRINT,
    FolderReceiver,
    commit_folder,
    version_dir,
    wait_committed,
)
from transport.manifest import Manifest, ManifestError, bucket_layout

CHAIN = "chain.json"
"""The file of a version folder that says how to rebuild it (see the module docstring)."""


def bucket_file(b: int) -> str:
    """The name of bucket `b`'s file in a version folder."""
    return f"bucket_{b:05d}.zst"


class DeltaFileSender(WeightSender):
    """Writes each version under `root` as a keyframe or a compressed delta (module docstring).

    Args:
        root: the shared folder (created if absent).
        keep: newest versions kept (>= 1), besides the older ones they need.
        full_every: a keyframe every this many versions (>= 1; 1 writes only keyframes).
        level: zstd compression level (1..22; 3 is zstd's default).

    Raises:
        ValueError: an argument out of its range.
    """

    def __init__(
        self, root: str | os.PathLike, keep: int = 2, full_every: int = 10, level: int = 3
    ) -> None:
        if keep < 1 or full_every < 1 or not 1 <= level <= 22:
            raise ValueError(
                f"need keep >= 1, full_every >= 1, 1 <= level <= 22; got {keep}, {full_every}, "
                f"{level}"
            )
        self.root, self.keep, self.full_every, self.level = Path(root), keep, full_every, level
        self.root.mkdir(parents=True, exist_ok=True)
        self._held: tuple[int, bytes, list[np.ndarray]] | None = None  # version, layout, bytes
        self._since_keyframe = 0

    def send(self, manifest: Manifest, tensors: Iterable[tuple[str, Any]]) -> SendStats:
        """See `WeightSender.send`; `SendStats.wire_bytes` is what the version's files hold.

        Raises:
            ManifestError: a name, order or shape that differs from the manifest.
        """
        import zstandard

        t0 = time.perf_counter()
        layout = layout_key(manifest)
        held = self._held
        delta = (
            held is not None
            and held[1] == layout
            and held[0] < manifest.version
            and self._since_keyframe + 1 < self.full_every
        )
        base = held[0] if delta and held is not None else None
        keyframe = self._keyframe_of(base) if base is not None else manifest.version
        tmp = self.root / f".tmp-v{manifest.version:010d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        buckets = manifest.buckets()
        raws: list[np.ndarray] = []
        hashes, sizes = [], []
        compressor = zstandard.ZstdCompressor(level=self.level)
        try:
            for b, packed in enumerate(iter_packed(manifest, tensors)):
                raw = packed.numpy().copy()
                base_raw = held[2][b] if delta and held is not None else None
                blob = encode_bucket(raw, base_raw, planes_of(manifest, buckets[b]), compressor)
                (tmp / bucket_file(b)).write_bytes(blob)
                raws.append(raw)
                hashes.append(digest(raw))
                sizes.append(len(blob))
            chain = {"version": manifest.version, "base": base, "keyframe": keyframe,
                     "sha256": hashes, "stored_bytes": sizes}  # fmt: skip
            (tmp / CHAIN).write_text(json.dumps(chain))
            (tmp / FINGERPRINT).write_bytes(manifest.fingerprint())
            commit_folder(tmp, version_dir(self.root, manifest.version))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._held = (manifest.version, layout, raws)
        self._since_keyframe = self._since_keyframe + 1 if delta else 0
        self._prune()
        return SendStats(
            manifest.version, manifest.total_bytes, len(buckets), time.perf_counter() - t0,
            wire_bytes=sum(sizes),
        )  # fmt: skip

    def _keyframe_of(self, version: int) -> int:
        return int(read_chain(self.root, version)["keyframe"])

    def _prune(self) -> None:
        """Delete every committed version but the newest `keep` and those they need."""
        committed = sorted(int(p.name[1:]) for p in self.root.iterdir() if p.name[:1] == "v")
        newest = committed[-self.keep :]
        needed = {v for top in newest for v in committed if self._keyframe_of(top) <= v <= top}
        for v in committed:
            if v not in needed:
                shutil.rmtree(version_dir(self.root, v), ignore_errors=True)


def read_chain(root: str | os.PathLike, version: int) -> dict[str, Any]:
    """The ``chain.json`` of a committed version.

    Raises:
        TransferError: the version is not on disk (pruned, or never written) or its
            ``chain.json`` is malformed.
    """
    path = version_dir(root, version) / CHAIN
    try:
        chain = dict(json.loads(path.read_text()))
        int(chain["keyframe"]), list(chain["sha256"])  # noqa: B018 - the fields must be there
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TransferError(f"version {version}: no readable {CHAIN} under {root}: {e}") from e
    return chain


class DeltaFileReceiver(FolderReceiver):
    """Waits for a committed version under `root` (see `FolderReceiver`), rebuilds it from the
    bytes it holds (or from the keyframe on disk) and loads it bucket by bucket."""

    def __init__(self, root: str | os.PathLike, timeout_s: float = 300.0, poll_s: float = 0.05):
        super().__init__(root, timeout_s, poll_s)
        self._held: tuple[int, list[np.ndarray]] | None = None  # the last version loaded

    def receive(self, manifest: Manifest, on_bucket: OnBucket) -> None:
        """See `WeightReceiver.receive`. Nothing is loaded unless every bucket of the version
        was rebuilt with the sender's SHA-256.

        Raises:
            ManifestError: the offered manifest differs from `manifest`.
            TransferError: not committed in time, a version of the chain is missing or
                corrupt, a rebuilt bucket's hash differs, or `on_bucket` raised (chained).
        """
        import torch

        d = wait_committed(self.root, manifest.version, self.timeout_s, self.poll_s)
        try:
            manifest.check_offered((d / FINGERPRINT).read_bytes())
        except ManifestError as e:
            raise ManifestError(f"{d}: {e}") from None
        raws = self._rebuild(manifest, manifest.version)
        for b, bucket in enumerate(manifest.buckets()):
            try:
                on_bucket(unpack(manifest, bucket, torch.from_numpy(raws[b])))
            except Exception as e:
                self._held = None  # the engine holds part of a version: rebuild from disk
                raise TransferError(f"loading version {manifest.version} failed: {e!r}") from e
        self._held = (manifest.version, raws)

    def _rebuild(self, manifest: Manifest, version: int) -> list[np.ndarray]:
        """Every bucket of `version` as packed bytes, checked against its SHA-256."""
        chain = read_chain(self.root, version)
        base = chain.get("base")
        if base is not None and not (
            isinstance(base, int) and int(chain["keyframe"]) <= base < version
        ):
            raise TransferError(
                f"version {version}: {CHAIN} names base {base!r}; a delta's base must be an "
                f"earlier version at or after its keyframe {chain['keyframe']!r}"
            )
        if base is None:
            bases = None
        elif self._held is not None and self._held[0] == base:
            bases = self._held[1]
        else:
            bases = self._rebuild(manifest, int(base))
        buckets = manifest.buckets()
        if len(chain["sha256"]) != len(buckets):
            raise TransferError(
                f"version {version} has {len(chain['sha256'])} buckets, the manifest {len(buckets)}"
            )
        out = []
        for b, bucket in enumerate(buckets):
            path = version_dir(self.root, version) / bucket_file(b)
            try:
                blob = path.read_bytes()
            except OSError as e:
                raise TransferError(f"reading bucket {b} of version {version}: {e}") from e
            where = f"bucket {b} of version {version} (base {base})"
            size = bucket_layout(manifest, bucket)[1]
            base_raw = bases[b] if bases is not None else None
            out.append(
                decode_bucket(blob, base_raw, planes_of(manifest, bucket), size,
                              chain["sha256"][b], where)
            )  # fmt: skip
        return out
