"""The resharding plan for sending each vLLM tensor-parallel rank only its own shard.

Pure index arithmetic (no torch, no JAX). Which part of a full HF tensor TP rank r holds is
mapping data (`mappings.shards.tp_slice`, by the tensor's shard kind); this module says how
that region is filled from the trainer's shards.

The trainer holds each tensor as FSDP shards, each a box of the full tensor (split along any
one dim, possibly replicated over a data-parallel axis). `pieces_for` lists the blocks that
move: which trainer shard's sub-block goes where in a TP rank's slice (fan-in when a slice
spans several shards, fan-out when one shard feeds several ranks, KV replication included).
`transport.sharded` runs it on the sender for every tensor of a sharded manifest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mappings.shards import Region

if TYPE_CHECKING:  # pure Python at import: `manifest.py` and `sync_plan.py` import this module
    pass


def tp_rank_of(group_rank: int, tp_size: int, senders: int = 1) -> int:
    """The engine TP rank of data-plane group rank `group_rank` (>= `senders`).

    The trainer numbers every engine's TP ranks consecutively after its sending processes
    (ranks 0..senders-1; one unless several trainer processes fan in, `transport.fan_in`):
    engine e's TP rank r is group rank `senders + e * tp_size + r` (`trainer.publish`), so
    `tp_rank = (group_rank - senders) % tp_size`.

    Raises:
        ValueError: a sender's rank, a tp_size < 1 or senders < 1.
    """
    if senders < 1 or group_rank < senders or tp_size < 1:
        raise ValueError(
            f"expected senders >= 1, group_rank >= senders and tp_size >= 1, got "
            f"{senders}, {group_rank}, {tp_size}"
        )
    return (group_rank - senders) % tp_size


@dataclass(frozen=True)
class Piece:
    """One block that moves from a trainer shard to a TP rank.

    Attributes:
        src: index of the trainer shard (the device holding it) in the list of boxes.
        src_region: the block inside that shard (shard-local indices).
        dst: TP rank receiving it.
        dst_region: where it lands inside that rank's slice (slice-local indices).
    """

    src: int
    src_region: Region
    dst: int
    dst_region: Region


def overlap(region: Region, box: Region) -> tuple[Region, Region] | None:
    """Where two regions of one full tensor meet, or None if they do not.

    Returns:
        (box-local, region-local): the intersection in indices relative to `box`'s start and
        to `region`'s start.
    """
    src, dst = [], []
    for r, b in zip(region, box, strict=True):
        lo, hi = max(r.start, b.start), min(r.stop, b.stop)
        if lo >= hi:
            return None
        src.append(slice(lo - b.start, hi - b.start))
        dst.append(slice(lo - r.start, hi - r.start))
    return tuple(src), tuple(dst)


def pieces_for(region: Region, boxes: list[Region], dst: int = 0) -> list[Piece]:
    """The blocks of trainer shards (`boxes`, one region of the full tensor per shard, any
    layout, replicas allowed: the first shard holding an element supplies it) that tile
    `region` exactly once.

    Raises:
        ValueError: the boxes do not cover `region`.
    """
    out: list[Piece] = []
    seen: set[tuple[tuple[int, int], ...]] = set()
    covered = 0
    for s, box in enumerate(boxes):
        key = tuple((b.start, b.stop) for b in box)
        if key in seen:  # a replica of a shard already used
            continue
        seen.add(key)
        hit = overlap(region, box)
        if hit is None:
            continue
        out.append(Piece(s, hit[0], dst, hit[1]))
        covered += math.prod(x.stop - x.start for x in hit[1])
    want = math.prod(r.stop - r.start for r in region)
    if covered != want:
        raise ValueError(f"trainer shards cover {covered} of the {want} elements of {region}")
    return out
