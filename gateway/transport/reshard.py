"""The resharding plan for sending each vLLM tensor-parallel rank only its own shard.

Pure index arithmetic (no torch, no JAX): given a full HF tensor's shape, how the engine shards
it, and the engine TP size, `tp_slice` says which part of the full tensor TP rank r holds, as
vLLM's own loaders take it:
- `column` (q_proj, gate_proj, up_proj, their biases): dim 0 split evenly,
  `ColumnParallelLinear` / `MergedColumnParallelLinear` / the "q" shard of `QKVParallelLinear`;
- `kv` (k_proj, v_proj, their biases): dim 0 by KV head; when tp > num_kv_heads each head is
  replicated on `tp // num_kv_heads` consecutive ranks (rank r takes head
  `r // (tp // num_kv_heads)`), as `QKVParallelLinear.weight_loader` does;
- `row` (o_proj, down_proj weights): dim 1 split evenly, `RowParallelLinear`;
- `vocab` (embed_tokens, lm_head): dim 0 over the vocab padded to a multiple of 64, each
  rank's range clipped to the real vocab, `VocabParallelEmbedding` / `ParallelLMHead`;
- `replicated` (norms, row-parallel biases): every rank takes the whole tensor.

The trainer holds each tensor as FSDP shards, each a box of the full tensor (split along any
one dim, possibly replicated over a data-parallel axis). `pieces_for` lists the blocks that
move: which trainer shard's sub-block goes where in a TP rank's slice (fan-in when a slice
spans several shards, fan-out when one shard feeds several ranks, KV replication included);
`plan` does it for every rank of an even FSDP split. `gateway.transport.sharded` runs it on
the sender for every tensor of a sharded manifest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # pure Python at import: `manifest.py` (and the gateway) import this module
    import numpy as np

ShardKind = Literal["column", "kv", "row", "vocab", "replicated"]
VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

Region = tuple[slice, ...]


def _split(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what}: size {n} is not divisible by {parts}")
    return n // parts


def tp_slice(
    shape: tuple[int, ...],
    kind: ShardKind,
    tp_size: int,
    tp_rank: int,
    num_kv_heads: int | None = None,
) -> Region:
    """The region of the full tensor that TP rank `tp_rank` of `tp_size` holds.

    Args:
        shape: full HF shape, e.g. `[num_kv_heads * head_dim, hidden]` for k_proj.
        kind: how the engine shards it (see the module docstring).
        tp_size, tp_rank: engine TP degree and this rank, 0 <= tp_rank < tp_size.
        num_kv_heads: total KV heads; required for `kv`.

    Returns:
        One slice per dim of `shape` (start/stop in full-tensor indices).

    Raises:
        ValueError: a bad rank, a missing `num_kv_heads`, or a size that does not split.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    full: list[slice] = [slice(0, d) for d in shape]
    if kind == "replicated":
        return tuple(full)
    if kind == "column":
        n = _split(shape[0], tp_size, "column dim 0")
        full[0] = slice(tp_rank * n, (tp_rank + 1) * n)
    elif kind == "row":
        if len(shape) < 2:
            raise ValueError(f"row-parallel tensors have 2 dims, got shape {shape}")
        n = _split(shape[1], tp_size, "row dim 1")
        full[1] = slice(tp_rank * n, (tp_rank + 1) * n)
    elif kind == "kv":
        if num_kv_heads is None:
            raise ValueError("kind 'kv' needs num_kv_heads")
        head_dim = _split(shape[0], num_kv_heads, "kv dim 0 by heads")
        if tp_size >= num_kv_heads:
            replicas = _split(tp_size, num_kv_heads, "tp_size by num_kv_heads")
            head = tp_rank // replicas
            full[0] = slice(head * head_dim, (head + 1) * head_dim)
        else:
            n = _split(num_kv_heads, tp_size, "num_kv_heads by tp_size") * head_dim
            full[0] = slice(tp_rank * n, (tp_rank + 1) * n)
    elif kind == "vocab":
        padded = -(-shape[0] // VOCAB_PAD) * VOCAB_PAD
        n = _split(padded, tp_size, "padded vocab")
        full[0] = slice(min(tp_rank * n, shape[0]), min((tp_rank + 1) * n, shape[0]))
    else:
        raise ValueError(f"unknown shard kind {kind!r}")
    return tuple(full)


def tp_rank_of(group_rank: int, tp_size: int) -> int:
    """The engine TP rank of data-plane group rank `group_rank` (>= 1).

    The trainer numbers every engine's TP ranks consecutively after the sender (rank 0):
    engine e's TP rank r is group rank `1 + e * tp_size + r` (`trainer.publish`), so
    `tp_rank = (group_rank - 1) % tp_size`.

    Raises:
        ValueError: group rank 0 (the sender) or a tp_size < 1.
    """
    if group_rank < 1 or tp_size < 1:
        raise ValueError(f"expected group_rank >= 1 and tp_size >= 1, got {group_rank}, {tp_size}")
    return (group_rank - 1) % tp_size


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


def fsdp_rows(n: int, fsdp_size: int) -> list[tuple[int, int]]:
    """Rows `[start, end)` of the full dim 0 that each of `fsdp_size` trainer shards holds."""
    k = _split(n, fsdp_size, "FSDP dim 0")
    return [(s * k, (s + 1) * k) for s in range(fsdp_size)]


def fsdp_boxes(shape: tuple[int, ...], fsdp_size: int, dim: int = 0) -> list[Region]:
    """The region of the full tensor each of `fsdp_size` trainer shards holds when the tensor
    is split evenly along `dim` (shard s holds `[s * n / S, (s + 1) * n / S)` of it)."""
    k = _split(shape[dim], fsdp_size, f"FSDP dim {dim}")
    boxes = []
    for s in range(fsdp_size):
        box = [slice(0, d) for d in shape]
        box[dim] = slice(s * k, (s + 1) * k)
        boxes.append(tuple(box))
    return boxes


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
