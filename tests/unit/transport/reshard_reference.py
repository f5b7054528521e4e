"""A reference resharding for the tests: every block of an even FSDP split that each TP rank's
`tp_slice` takes (`plan`), run on host arrays (`apply_plan`). The package itself plans per
tensor from the trainer's real shards (`transport.reshard.pieces_for`); these are the oracle
its tests compare against. Not a test module."""

from __future__ import annotations

import numpy as np

from mappings.shards import Region, ShardKind, split_evenly, tp_slice
from transport.reshard import Piece, pieces_for


def fsdp_rows(n: int, fsdp_size: int) -> list[tuple[int, int]]:
    """Rows `[start, end)` of the full dim 0 that each of `fsdp_size` trainer shards holds."""
    k = split_evenly(n, fsdp_size, "FSDP dim 0")
    return [(s * k, (s + 1) * k) for s in range(fsdp_size)]


def fsdp_boxes(shape: tuple[int, ...], fsdp_size: int, dim: int = 0) -> list[Region]:
    """The region of the full tensor each of `fsdp_size` trainer shards holds when the tensor
    is split evenly along `dim` (shard s holds `[s * n / S, (s + 1) * n / S)` of it)."""
    k = split_evenly(shape[dim], fsdp_size, f"FSDP dim {dim}")
    boxes = []
    for s in range(fsdp_size):
        box = [slice(0, d) for d in shape]
        box[dim] = slice(s * k, (s + 1) * k)
        boxes.append(tuple(box))
    return boxes


def plan(
    shape: tuple[int, ...],
    kind: ShardKind,
    tp_size: int,
    fsdp_size: int,
    num_kv_heads: int | None = None,
    fsdp_dim: int = 0,
) -> list[Piece]:
    """Every block to move so each TP rank gets exactly its `tp_slice`, from `fsdp_size`
    trainer shards split along `fsdp_dim` (`fsdp_boxes`). Fan-in when a TP slice spans
    several shards, fan-out when one shard feeds several ranks.

    Returns:
        Pieces ordered by (dst, src). Per TP rank they tile its slice exactly once.
    """
    boxes = fsdp_boxes(shape, fsdp_size, fsdp_dim)
    out: list[Piece] = []
    for r in range(tp_size):
        out += pieces_for(tp_slice(shape, kind, tp_size, r, num_kv_heads), boxes, r)
    return out


def apply_plan(
    pieces: list[Piece],
    shards: list[np.ndarray],
    shape: tuple[int, ...],
    kind: ShardKind,
    tp_size: int,
    num_kv_heads: int | None = None,
) -> list[np.ndarray]:
    """Run a plan on host arrays: the tensor each TP rank ends up with (the reference the
    device transports follow; used by the tests)."""
    import numpy as np

    out = []
    for r in range(tp_size):
        region = tp_slice(shape, kind, tp_size, r, num_kv_heads)
        out.append(np.zeros([x.stop - x.start for x in region], dtype=shards[0].dtype))
    for p in pieces:
        out[p.dst][p.dst_region] = shards[p.src][p.src_region]
    return out
