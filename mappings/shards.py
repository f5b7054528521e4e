"""How an engine's tensor parallelism splits each HF tensor: the shard kinds and `tp_slice`.

Mapping data, not transport: a mapping rule names its tensor's kind (`Rule.shard_kind`), and
the data plane (`transport.manifest`, `transport.reshard`) asks `tp_slice` which part of the
full tensor each engine TP rank holds. Pure index arithmetic (no torch, numpy or JAX), as
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

`tests/unit/transport/test_reshard.py` holds every kind against vLLM's loaders.
"""

from __future__ import annotations

from typing import Literal, get_args

ShardKind = Literal["column", "kv", "row", "vocab", "replicated"]
#: Every `ShardKind`, in its declared order.
SHARD_KINDS: tuple[str, ...] = get_args(ShardKind)
VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

#: One slice per dim of a full tensor (start/stop in full-tensor indices).
Region = tuple[slice, ...]


def split_evenly(n: int, parts: int, what: str) -> int:
    """`n // parts`, the size of each of `parts` equal pieces of `n`.

    Raises:
        ValueError: `n` is not divisible by `parts` (the message names `what`).
    """
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
        n = split_evenly(shape[0], tp_size, "column dim 0")
        full[0] = slice(tp_rank * n, (tp_rank + 1) * n)
    elif kind == "row":
        if len(shape) < 2:
            raise ValueError(f"row-parallel tensors have 2 dims, got shape {shape}")
        n = split_evenly(shape[1], tp_size, "row dim 1")
        full[1] = slice(tp_rank * n, (tp_rank + 1) * n)
    elif kind == "kv":
        if num_kv_heads is None:
            raise ValueError("kind 'kv' needs num_kv_heads")
        head_dim = split_evenly(shape[0], num_kv_heads, "kv dim 0 by heads")
        if tp_size >= num_kv_heads:
            replicas = split_evenly(tp_size, num_kv_heads, "tp_size by num_kv_heads")
            head = tp_rank // replicas
            full[0] = slice(head * head_dim, (head + 1) * head_dim)
        else:
            n = split_evenly(num_kv_heads, tp_size, "num_kv_heads by tp_size") * head_dim
            full[0] = slice(tp_rank * n, (tp_rank + 1) * n)
    elif kind == "vocab":
        padded = -(-shape[0] // VOCAB_PAD) * VOCAB_PAD
        n = split_evenly(padded, tp_size, "padded vocab")
        full[0] = slice(min(tp_rank * n, shape[0]), min((tp_rank + 1) * n, shape[0]))
    else:
        raise ValueError(f"unknown shard kind {kind!r}")
    return tuple(full)
