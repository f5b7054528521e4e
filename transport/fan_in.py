"""Fan-in: a version sent by several trainer processes, each only the blocks it holds.

A manifest with `senders` P > 1 names, per tensor, the blocks that make it up and which sender
holds each (`Manifest.sources`: `(sender, box)` pairs tiling the full tensor once; the trainer
takes them from its arrays' global shardings, `trainer.publish.local_shards`). Group ranks
0..P-1 are the senders, P.. the engines' TP ranks. Per bucket, sender p sends every receiver one
message (point to point): the parts of its blocks that fall in that receiver's region of each
tensor of the bucket (the whole tensor, or with `tp_size` > 1 its TP rank's region,
`Manifest.region`), each part C-contiguous, in bucket order then source order, at
`ALIGN`-aligned offsets. A receiver computes the same layout from the same manifest, receives
one message from each sender that has something for it, and copies each part into place in
its bucket buffer (laid out as `sharded.rank_layout` of the whole bucket: its region of every
tensor). Both ends compute every size from the manifest, so nothing but the data travels;
a sender with no part for a receiver sends it nothing.

Pure index arithmetic plus the copies (torch imported lazily, as in every transport module).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mappings.shards import Region
from transport.base import Bucket, as_torch
from transport.manifest import DTYPE_BYTES, Box, Manifest, ManifestError, aligned_offsets
from transport.reshard import overlap
from transport.sharded import _shape, _view, rank_layout

if TYPE_CHECKING:
    import torch


def region_of(box: Box) -> Region:
    """A box (`(start, stop)` per dim) as a region (a slice per dim)."""
    return tuple(slice(a, b) for a, b in box)


def sources_of(manifest: Manifest, i: int) -> list[tuple[int, Region]]:
    """Tensor `i`'s blocks as (sender, region of the full tensor), in manifest order: its
    `sources` entry, or the whole tensor from sender 0 when it has none."""
    entry = manifest.sources[i] if manifest.sources else ()
    if not entry:
        return [(0, tuple(slice(0, d) for d in manifest.tensors[i].shape))]
    return [(s, region_of(box)) for s, box in entry]


def boxes_of(manifest: Manifest, i: int, sender: int) -> list[Region]:
    """The blocks of tensor `i` that `sender` holds and sends, in source order (what its
    array list for that tensor must hold, `pack`)."""
    return [r for s, r in sources_of(manifest, i) if s == sender]


@dataclass(frozen=True)
class Part:
    """One contiguous part of a message: a block's overlap with a receiver's region.

    Attributes:
        tensor: index into `manifest.tensors`.
        block: index of the block among the sender's blocks of that tensor (`boxes_of`).
        src: the part inside the block (block-local indices).
        dst: the part inside the receiver's region of the tensor (region-local indices).
        offset: byte offset of the part in the message.
        nbytes: its size in bytes.
    """

    tensor: int
    block: int
    src: Region
    dst: Region
    offset: int
    nbytes: int


def message_layout(
    manifest: Manifest, bucket: list[int], sender: int, tp_rank: int
) -> tuple[list[Part], int]:
    """What `sender`'s message of one bucket holds for a receiver of TP rank `tp_rank`.

    Returns:
        (parts in message order, total bytes); total 0 means no message is sent.
    """
    parts: list[tuple[int, int, Region, Region, int]] = []
    for i in bucket:
        region = manifest.region(i, tp_rank)
        size = DTYPE_BYTES[manifest.tensors[i].dtype]
        for j, box in enumerate(boxes_of(manifest, i, sender)):
            hit = overlap(region, box)
            if hit is not None:
                parts.append((i, j, hit[0], hit[1], math.prod(_shape(hit[1])) * size))
    offsets, total = aligned_offsets([p[4] for p in parts])
    laid = [Part(i, j, s, d, o, n) for (i, j, s, d, n), o in zip(parts, offsets, strict=True)]
    return laid, total


def pack(
    manifest: Manifest, parts: list[Part], blocks: dict[int, list[Any]], buf: torch.Tensor
) -> None:
    """Copy each part out of this sender's blocks into the message buffer `buf`, cast to the
    tensor's wire dtype.

    Args:
        parts: a `message_layout` of this sender.
        blocks: tensor index -> its blocks (numpy, torch or single-device JAX arrays, shapes
            of `boxes_of`), as this sender holds them.
        buf: uint8 `[total]`.

    Raises:
        ManifestError: a block missing, or of another shape than its box.
    """
    for part in parts:
        spec = manifest.tensors[part.tensor]
        try:
            block = blocks[part.tensor][part.block]
        except (KeyError, IndexError):
            raise ManifestError(
                f"{spec.name}: this sender holds no block {part.block} of it"
            ) from None
        dst = _view(buf, part.offset, spec.dtype, _shape(part.dst))
        dst.copy_(as_torch(block)[part.src])


def receiver_layout(manifest: Manifest, bucket: list[int], tp_rank: int) -> tuple[list, int]:
    """A receiver's buffer of one bucket: its region of every tensor, in bucket order
    (`sharded.rank_layout`); returns ([(tensor index, byte offset, region)], total bytes)."""
    return rank_layout(manifest, tuple(bucket), tp_rank)


def scatter(
    manifest: Manifest, parts: list[Part], message: torch.Tensor, out: torch.Tensor,
    layout: list,
) -> None:  # fmt: skip
    """Copy each part of a received `message` (uint8) into its place in the receiver's bucket
    buffer `out` (uint8, laid out as `layout` from `receiver_layout`)."""
    where = {i: (off, region) for i, off, region in layout}
    for part in parts:
        spec = manifest.tensors[part.tensor]
        off, region = where[part.tensor]
        whole = _view(out, off, spec.dtype, _shape(region))
        whole[part.dst].copy_(_view(message, part.offset, spec.dtype, _shape(part.dst)))


def bucket_views(manifest: Manifest, bucket: list[int], out: torch.Tensor, layout: list) -> Bucket:
    """(name, view) of each tensor of a received bucket, in bucket order: the receiver's
    region of it (shape `[region extents]`)."""
    return [
        (manifest.tensors[i].name, _view(out, off, manifest.tensors[i].dtype, _shape(region)))
        for i, off, region in layout
    ]


def sent_bytes(manifest: Manifest, sender: int, tp_ranks: list[int]) -> int:
    """Payload bytes `sender` sends in one version to receivers of the given TP ranks (one
    entry per receiving rank)."""
    total = 0
    for bucket in manifest.buckets():
        for tp in tp_ranks:
            total += sum(p.nbytes for p in message_layout(manifest, bucket, sender, tp)[0])
    return total
