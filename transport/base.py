"""The data-plane interface: a sender pushes one version, receivers load it bucket by bucket.

Protocol, the same for every transport:
1. the sender offers the `Manifest` (version, names, shapes, dtypes, bucket size);
2. each receiver compares it with the manifest it was told to expect and accepts or refuses
   (a refusal raises on both sides before any tensor moves);
3. the sender streams the buckets (`Manifest.buckets`), each packed into one byte buffer
   (`bucket_layout`), or for a sharded manifest (`Manifest.tp_size` > 1, collective
   transports only) into one buffer of its replicated tensors plus one per TP rank
   (`transport.sharded`), and each receiver hands every bucket to its `on_bucket`
   callback;
4. the version is committed only when every receiver has had every bucket loaded without
   error: `send` returns and `receive` returns only then; otherwise both raise
   `TransferError`.

torch is imported lazily inside the helpers, never at module import (a test holds every
transport module to that).
"""

from __future__ import annotations

import contextlib
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mappings.shards import Region
from transport.cast_kernel import transpose_cast
from transport.manifest import Manifest, ManifestError, bucket_layout
from transport.reshard import pieces_for

if TYPE_CHECKING:
    import torch

# One bucket as handed to a receiver's callback: (name, tensor) pairs in the manifest's dtype,
# of the manifest's full shape, or, for a sharded manifest (`Manifest.tp_size` > 1), of this
# TP rank's region (`Manifest.region`); views into the received buffer.
Bucket = list[tuple[str, "torch.Tensor"]]
OnBucket = Callable[[Bucket], None]


class TransferError(RuntimeError):
    """A version did not arrive whole: refused, timed out, or failed to load somewhere."""


@dataclass(frozen=True)
class SendStats:
    """What one `send` moved.

    Attributes:
        version: the committed version.
        num_bytes: the version's payload bytes (sum of full tensor sizes, padding excluded;
            with a sharded manifest each TP rank receives only its part of them).
        num_buckets: number of buckets.
        seconds: wall time of the whole send, manifest to commit.
        wire_bytes: bytes the transport moved or stored for it, when they differ from
            `num_bytes` (a compressed delta, `transport.file_delta`); None: `num_bytes`.
        phases: seconds of `seconds` by phase, where the transport times them (a collective
            sender: "offer_s" the manifest offer and accept vote, "pack_s" packing the
            buckets, "wire_s" waiting for them on the wire beyond the packing, "commit_s"
            the commit vote, which waits for the receivers' last load); empty otherwise.
    """

    version: int
    num_bytes: int
    num_buckets: int
    seconds: float
    wire_bytes: int | None = None
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        """Payload throughput in GB/s (1e9 bytes)."""
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9


class WeightSender(ABC):
    """The trainer side of a transport."""

    @abstractmethod
    def send(self, manifest: Manifest, tensors: Iterable[tuple[str, Any]]) -> SendStats:
        """Push one version and return once every receiver committed it.

        Args:
            manifest: the version's tensors in order, and the bucket size.
            tensors: (name, array) pairs in manifest order; arrays may be torch tensors,
                numpy arrays or anything with `__dlpack__` (JAX arrays); each is cast to its
                manifest dtype while packed. Consumed lazily, one bucket at a time.

        Raises:
            ManifestError: a tensor's name or shape differs from the manifest.
            TransferError: a receiver refused the manifest, failed to load, or timed out.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and buffers."""


class WeightReceiver(ABC):
    """The engine side of a transport."""

    @abstractmethod
    def receive(self, manifest: Manifest, on_bucket: OnBucket) -> None:
        """Receive the version described by `manifest`, calling `on_bucket` on each bucket.

        Returns only once the whole version arrived and every receiver loaded it.

        Raises:
            ManifestError: the offered manifest differs from `manifest`.
            TransferError: the stream broke, timed out, `on_bucket` raised (chained), or
                another receiver failed.
        """

    def refuse(self, reason: str) -> None:
        """Turn down the version on offer, telling the sender where the transport can.

        Raises:
            TransferError: always, carrying `reason`.
        """
        raise TransferError(f"refused: {reason}")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and buffers."""


def as_torch(x: Any) -> torch.Tensor:
    """A torch view of `x` without a copy where the platform allows.

    Args:
        x: a torch tensor, a numpy array (ml_dtypes bfloat16 included; strided views are
            kept strided: a transposed view becomes a transposed torch view, and the copy that
            packs it does the transpose) or any object with `__dlpack__` (a JAX array).

    Returns:
        A CPU or device torch tensor sharing memory with `x` where possible.
    """
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if any(s < 0 or s % x.itemsize for s in x.strides):  # torch takes neither
            x = np.ascontiguousarray(x)
        with warnings.catch_warnings():
            # JAX hands out read-only buffers; the data plane only reads them, never writes.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            if x.dtype.name == "bfloat16":
                return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
            return torch.from_numpy(x)
    if hasattr(x, "__dlpack__"):
        return torch.from_dlpack(x)
    raise TypeError(f"expected a torch tensor, numpy array or dlpack array, got {type(x)}")


def _full_box(index: tuple, shape: tuple[int, ...]) -> Region:
    """A JAX shard's `index` (slices, possibly open-ended) as a region of the full tensor."""
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape, strict=True))


def write_region(dst: torch.Tensor, array: Any, region: Region) -> None:
    """`dst[...] = array[region]`, cast to `dst`'s dtype.

    Args:
        dst: the destination, shape `[region's extents]`.
        array: the full tensor: a torch tensor, a numpy array, or a JAX array, possibly
            sharded over several devices; then only the blocks of the shards that overlap
            `region` are read (each through dlpack where the platform allows), never the
            whole tensor.
        region: one slice per dim, in full-tensor indices.
    """
    shards = getattr(array, "addressable_shards", None)
    if shards is not None and len(shards) > 1 and not array.is_fully_replicated:
        shape = tuple(array.shape)
        boxes = [_full_box(sh.index, shape) for sh in shards]
        for p in pieces_for(region, boxes):
            dst[p.dst_region].copy_(as_torch(shards[p.src].data[p.src_region]))
        return
    if shards is not None and len(shards) > 1:  # replicated on several devices: one copy
        array = shards[0].data
    copy_cast(dst, as_torch(array)[region])


def copy_cast(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, casting to `dst`'s dtype; a transposed matrix of another dtype (the
    linear layers a mapping hands over as views `[out, in]` of `[in, out]` params) is cast
    first, contiguous, into a scratch tensor, then transposed in the wire dtype: torch's
    strided copy-and-cast element by element is the slowest part of packing on CPU (1.7x the
    time of the two passes, `pack_s` of `benchmarks/weight_sync.py`).

    A float32 view of that kind (or a slice of its rows) cast to bfloat16 goes through the
    native kernel instead (`transport.cast_kernel`: one pass, 16 x 16 tiles), where built.

    Args:
        dst: the destination, contiguous, of `src`'s shape.
        src: any torch tensor of that shape.
    """
    if transpose_cast(dst, src):
        return
    t = src.T if src.dim() == 2 else None
    if (
        t is not None and src.dtype != dst.dtype and not src.is_contiguous()
        and t.is_contiguous() and dst.is_contiguous()
    ):  # fmt: skip
        import torch

        scratch = torch.empty(t.shape, dtype=dst.dtype, device=dst.device)
        scratch.copy_(t)
        dst.copy_(scratch.T)
        return
    dst.copy_(src)


def next_tensor(it: Iterator[tuple[str, Any]], manifest: Manifest, i: int) -> Any:
    """The next (name, array) of a sender's stream, checked to be tensor `i` of `manifest`.

    Returns:
        The array (any type `write_region` takes).

    Raises:
        ManifestError: the stream ended, or the name or shape differs from the manifest's.
    """
    spec = manifest.tensors[i]
    try:
        name, arr = next(it)
    except StopIteration:
        raise ManifestError(
            f"tensors ran out at {spec.name!r} ({i} of {len(manifest.tensors)})"
        ) from None
    if name != spec.name:
        raise ManifestError(f"tensor {i}: got {name!r}, manifest says {spec.name!r}")
    if tuple(arr.shape) != spec.shape:
        raise ManifestError(f"{name}: shape {list(arr.shape)}, manifest says {list(spec.shape)}")
    return arr


class BufferPool:
    """Send buffers kept between buckets and between pushes: `get(key, n)` returns a uint8
    `[n]` view of one buffer per key, grown (never shrunk) as needed.

    A sender packs its buckets into the same few buffers: the page faults of a fresh buffer
    per bucket cost about as much as the packing copy itself on CPU. A packer with `slots` S
    rotates bucket k through slot k mod S (`slot_key`), so bucket k+1 can be packed while
    bucket k is still on the wire; the pool then holds about S buckets between pushes;
    `clear` frees them. A buffer is reused only after the collective that read it was waited
    on (on GPUs the next packing copy is ordered after it on the stream).
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        """A uint8 `[nbytes]` view of buffer `key` (its contents are undefined)."""
        import torch

        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            self._buffers.pop(key, None)  # free the old one before allocating
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[key] = buf
        return buf[:nbytes]

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(int(b.numel()) for b in self._buffers.values())

    def clear(self) -> None:
        """Free every buffer."""
        self._buffers.clear()


def slot_key(key: str, bucket: int, slots: int) -> str:
    """The pool key of buffer `key` for the `bucket`-th bucket when a packer rotates `slots`
    buffers per key (see `BufferPool`)."""
    return key if slots == 1 else f"{key}@{bucket % slots}"


def iter_packed(
    manifest: Manifest,
    tensors: Iterable[tuple[str, Any]],
    device: str = "cpu",
    pool: BufferPool | None = None,
    slots: int = 1,
) -> Iterator[torch.Tensor]:
    """Pack tensors into one uint8 buffer per bucket, casting each to its manifest dtype.

    Args:
        pool: where the buffers come from: `slots` reused buffers in turn (bucket k goes to
            slot k mod `slots`; be done with bucket k before asking for bucket k + `slots`);
            None allocates a fresh buffer per bucket on `device`.
        slots: how many buckets may be in use at once (2: one on the wire, one packing).

    Yields:
        One uint8 tensor `[bucket_total_bytes]` per bucket, in order.

    Raises:
        ManifestError: a name, order or shape that differs from the manifest, or too few
            or too many tensors.
    """
    import torch

    pool = pool or FreshBuffers(device)
    it = iter(tensors)
    for k, bucket in enumerate(manifest.buckets()):
        offsets, total = bucket_layout(manifest, bucket)
        buf = pool.get(slot_key("bucket", k, slots), total)
        with one_thread():
            for i, off in zip(bucket, offsets, strict=True):
                spec = manifest.tensors[i]
                arr = next_tensor(it, manifest, i)
                dst = buf[off : off + spec.nbytes].view(getattr(torch, spec.dtype))
                write_region(dst.view(spec.shape), arr, tuple(slice(0, d) for d in spec.shape))
        yield buf
    extra = next(it, None)
    if extra is not None:
        raise ManifestError(f"more tensors than the manifest lists, starting with {extra[0]!r}")


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's CPU copies inside on one intra-op thread, then restore the count.

    Packing is one `copy_` per tensor; with several OpenMP threads each copy is a parallel
    region whose threads wait for each other, and on a host whose cores are shared (other
    processes: the engine, the gloo sender's own thread) a descheduled thread holds every
    region up: SmolLM2's tensors packed at 0.2 GB/s on 2 threads against 10.6 GB/s on one,
    in the same run on a host whose cores were shared (`benchmarks/weight_sync.py`'s
    `pack_s`). One memory-bound copy per tensor gains little from a second thread anyway.
    """
    import torch

    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


class FreshBuffers(BufferPool):
    """A pool that keeps nothing: a fresh uint8 buffer on its device per `get`."""

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


def unpack(manifest: Manifest, bucket: list[int], buf: torch.Tensor) -> Bucket:
    """Views of each tensor of a bucket inside its packed uint8 buffer `[total_bytes]`."""
    import torch

    offsets, _ = bucket_layout(manifest, bucket)
    out: Bucket = []
    for i, off in zip(bucket, offsets, strict=True):
        spec = manifest.tensors[i]
        view = buf[off : off + spec.nbytes].view(getattr(torch, spec.dtype)).view(spec.shape)
        out.append((spec.name, view))
    return out
