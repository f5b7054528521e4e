"""Per-rank delivery of a sharded manifest (`Manifest.tp_size` > 1): what each TP rank's buffer
of a bucket holds, packing it from full or FSDP-sharded arrays, and unpacking it.

A bucket splits in two parts:
- its replicated tensors (norms), packed whole in one buffer that every receiver gets (a
  broadcast);
- its sharded tensors, packed per TP rank: rank r's buffer holds, in bucket order, only the
  region `Manifest.region(i, r)` of each (`mappings.shards.tp_slice`, exactly what
  vLLM's loaders take for rank r), so each rank receives about 1/tp of those bytes.

The sender fills a rank's buffer straight from the trainer's shards: for a JAX array sharded
over the trainer's devices (FSDP), each shard's block that overlaps the rank's region
(`reshard.pieces_for`) is copied into place, so no device ever holds a whole tensor. That is
fan-in when a rank's region spans several trainer shards and fan-out when one trainer shard
feeds several ranks. torch is imported lazily, as in every transport module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mappings.shards import Region
from transport.base import (
    Bucket,
    BufferPool,
    FreshBuffers,
    next_tensor,
    slot_key,
    write_region,
)
from transport.manifest import (
    DTYPE_BYTES,
    Manifest,
    ManifestError,
    aligned_offsets,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class BucketSplit:
    """The two parts of one bucket of a sharded manifest.

    Attributes:
        replicated: indices (into `manifest.tensors`) of the tensors every rank gets whole.
        sharded: indices of the tensors each TP rank gets only its region of.
    """

    replicated: tuple[int, ...]
    sharded: tuple[int, ...]


def split_bucket(manifest: Manifest, bucket: list[int]) -> BucketSplit:
    """Separate a bucket's replicated tensors from its sharded ones (bucket order kept)."""
    rep = tuple(i for i in bucket if manifest.tensors[i].shard == "replicated")
    shd = tuple(i for i in bucket if manifest.tensors[i].shard != "replicated")
    return BucketSplit(rep, shd)


def _shape(region: Region) -> tuple[int, ...]:
    return tuple(r.stop - r.start for r in region)


def rank_layout(
    manifest: Manifest, indices: tuple[int, ...], tp_rank: int
) -> tuple[list[tuple[int, int, Region]], int]:
    """Where each tensor's region for `tp_rank` sits in that rank's packed buffer.

    Returns:
        ([(tensor index, byte offset, region of the full tensor)], total bytes), offsets
        aligned to `manifest.ALIGN`.
    """
    regions = [manifest.region(i, tp_rank) for i in indices]
    sizes = [
        math.prod(_shape(r)) * DTYPE_BYTES[manifest.tensors[i].dtype]
        for i, r in zip(indices, regions, strict=True)
    ]
    offsets, total = aligned_offsets(sizes)
    return list(zip(indices, offsets, regions, strict=True)), total


def _view(buf: torch.Tensor, off: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    import torch

    n = math.prod(shape) * DTYPE_BYTES[dtype]
    return buf[off : off + n].view(getattr(torch, dtype)).view(shape)


@dataclass
class PackedBucket:
    """One bucket of a sharded manifest, ready to send.

    Attributes:
        replicated: uint8 `[bytes]` of the replicated tensors, or None when there are none.
        per_rank: TP rank -> uint8 `[bytes]` of that rank's regions (empty when the bucket
            has no sharded tensor).
    """

    replicated: torch.Tensor | None
    per_rank: dict[int, torch.Tensor]


def iter_packed_sharded(
    manifest: Manifest,
    tensors: Iterable[tuple[str, Any]],
    tp_ranks: Iterable[int],
    device: str = "cpu",
    pool: BufferPool | None = None,
    slots: int = 1,
) -> Iterator[PackedBucket]:
    """Pack each bucket for per-rank delivery, casting to the manifest dtypes.

    Args:
        manifest: a sharded manifest.
        tensors: (name, full array) in manifest order, as `write_region` takes them.
        tp_ranks: the TP ranks some receiver has (a buffer is packed once per rank).
        device: where the buffers live (the sender's device).
        pool: where the buffers come from: `slots` reused sets in turn (bucket k uses set k
            mod `slots`: be done sending bucket k before asking for bucket k + `slots`); None
            allocates fresh ones per bucket on `device`.
        slots: how many buckets may be in use at once (see `transport.base.iter_packed`).

    Yields:
        One `PackedBucket` per bucket of `manifest.buckets()`, in order.

    Raises:
        ManifestError: a name or shape that differs from the manifest, or too few or too
            many tensors.
    """

    pool = pool or FreshBuffers(device)
    ranks = sorted(set(tp_ranks))
    it = iter(tensors)
    for k, bucket in enumerate(manifest.buckets()):
        split = split_bucket(manifest, bucket)
        rep_layout = rank_layout(manifest, split.replicated, 0)
        layouts = {r: rank_layout(manifest, split.sharded, r) for r in ranks}
        rep = pool.get(slot_key("replicated", k, slots), rep_layout[1])
        per_rank = {
            r: pool.get(slot_key(f"rank{r}", k, slots), total) for r, (_, total) in layouts.items()
        }
        where = {i: (rep, off, region) for i, off, region in rep_layout[0]}
        for i in bucket:
            spec = manifest.tensors[i]
            arr = next_tensor(it, manifest, i)
            if i in where:
                buf, off, region = where[i]
                write_region(_view(buf, off, spec.dtype, _shape(region)), arr, region)
                continue
            for r, (entries, _) in layouts.items():
                _, off, region = next(e for e in entries if e[0] == i)
                write_region(_view(per_rank[r], off, spec.dtype, _shape(region)), arr, region)
        yield PackedBucket(rep if split.replicated else None, per_rank if split.sharded else {})
    extra = next(it, None)
    if extra is not None:
        raise ManifestError(f"more tensors than the manifest lists, starting with {extra[0]!r}")


def unpack_rank(
    manifest: Manifest,
    bucket: list[int],
    tp_rank: int,
    replicated: torch.Tensor | None,
    mine: torch.Tensor | None,
) -> Bucket:
    """Views, in bucket order, of what TP rank `tp_rank` received for one bucket: whole
    replicated tensors and its own region of each sharded one (shape `[region extents]`;
    `Manifest.region(i, tp_rank)` says where it sits in the full tensor)."""
    split = split_bucket(manifest, bucket)
    views: dict[int, torch.Tensor] = {}
    for indices, buf, rank in ((split.replicated, replicated, 0), (split.sharded, mine, tp_rank)):
        if not indices:
            continue
        assert buf is not None
        for i, off, region in rank_layout(manifest, indices, rank)[0]:
            views[i] = _view(buf, off, manifest.tensors[i].dtype, _shape(region))
    return [(manifest.tensors[i].name, views[i]) for i in bucket]
