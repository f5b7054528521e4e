"""Extension prefill: continue samples in the slots whose KV cache already holds a prefix of
their prompts, running the model only on the new tokens.

Legend: P rows (padded to a power of two), T new-token bucket (`length_bucket`), S cache slots
(positions), V vocabulary.

A multi-turn episode's next turn is its previous turn's prompt and completion plus the
environment's tokens. The slot that sampled the previous turn still holds the KV of all but its
last token (the last emitted token is fed at the next step, so it is not cached yet); this
prefill reads that slot's cache row, computes the new tokens' keys and values at their
absolute positions (attending to the cached prefix, as a decode step does), and returns only
that window of T new positions as a `PrefillBatch` with `positions`: the usual slot
substitution then samples each row's first token from the last new token's logits and writes
the window (not the whole row) back into the slot. No earlier position is recomputed or
rewritten. Padding tokens carry position S, so their writes are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.kernels.scope import scoped
from models.kv_cache import KVCache
from rollout_engine.jax.prefill import PrefillBatch, doubling_bound, length_bucket, next_pow2
from rollout_engine.jax.state import SlotState


def _extend(
    graphdef: nnx.GraphDef,
    kv_len: int,
    params: nnx.State,
    state: SlotState,
    slots: jax.Array,
    tokens: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
) -> PrefillBatch:
    model = nnx.merge(graphdef, params)
    p, t = tokens.shape
    s = state.max_len
    offs = jnp.arange(t, dtype=jnp.int32)[None]
    positions = jnp.where(offs < lengths[:, None], start[:, None] + offs, s)  # pads: dropped
    # the rows' first kv_len slots (every new token's position is below kv_len)
    rows = KVCache(
        k=tuple(k[slots, :, :kv_len] for k in state.cache.k),
        v=tuple(v[slots, :, :kv_len] for v in state.cache.v),
    )
    with jax.named_scope("extend"):
        hidden, cache = model.hidden(tokens, positions, rows)  # [P, T, D], rows [P, kv_len]
    last = hidden[jnp.arange(p), lengths - 1]  # [P, D]
    at = jnp.minimum(positions, kv_len - 1)[:, None, :, None]  # [P, 1, T, 1] the new tokens

    def window(x: jax.Array) -> jax.Array:
        return jnp.take_along_axis(x, at, axis=2)  # [P, K, S, H] -> [P, K, T, H]

    new = KVCache(k=tuple(map(window, cache.k)), v=tuple(map(window, cache.v)))
    return PrefillBatch(new, model.logits(last), start + lengths, positions)


class Extender:
    """Pads continuations into (P, T) buckets (P a power of two, T a `length_bucket`) and runs
    the compiled extension.

    Args:
        graphdef: ``nnx.split(decoder)[0]``. cfg: the model config.
        pad_id: token used for padding. min_len: smallest T bucket. batch: most rows per call
            (every call is padded to P = next_pow2(batch) rows).
        kv_bucket: smallest attention bound in cache slots: a call reads and attends to
            only its rows' first kv_len slots, kv_len the smallest ``kv_bucket * 2**k``
            past every new token's position (capped at S), as a decode call does
            (`BatcherConfig.kv_bucket`); 0: all S slots. A short history in a long slot
            then costs what it holds: SmolLM2 (float32, bf16 cache), 16 rows of 28 new
            tokens at position 100, S = 2048: 2.35 s a call over every slot, 0.86 s over
            the first 128 (docs/benchmarks.md).
        native: trace inside `models.kernels.scope.native_scope` (the native CPU kernels
            where available; a one-device replica only).
    """

    def __init__(
        self, graphdef: nnx.GraphDef, cfg: ModelConfig, *, pad_id: int, min_len: int = 16,
        batch: int = 1, kv_bucket: int = 0, native: bool = False,
    ):  # fmt: skip
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if kv_bucket < 0:
            raise ValueError(f"kv_bucket must be >= 0 (0: every slot), got {kv_bucket}")
        self.graphdef, self.cfg, self.pad_id = graphdef, cfg, pad_id
        self.min_len, self.batch, self.kv_bucket = min_len, batch, kv_bucket
        self.native = native
        self._compiled: dict[tuple[int, int, int], Callable[..., PrefillBatch]] = {}

    @property
    def buckets(self) -> list[tuple[int, int, int]]:
        """The (P, T, kv_len) shapes compiled so far."""
        return sorted(self._compiled)

    def __call__(
        self,
        params: nnx.State,
        state: SlotState,
        slots: Sequence[int],
        new_tokens: Sequence[Sequence[int]],
        starts: Sequence[int],
    ) -> PrefillBatch:
        """Row i: the keys and values of ``new_tokens[i]`` at positions ``starts[i]`` onward
        of slot ``slots[i]`` (cache ``[P, T]``, `PrefillBatch.positions` ``[P, T]``);
        ``lengths`` of the result = ``starts[i] + len(new_tokens[i])`` (the position of the
        first token to sample).

        Raises:
            ValueError: no rows or more than ``batch``, an empty continuation, or one that
                ends past the slot's cache length S.
        """
        n = len(slots)
        if not 1 <= n <= self.batch or len(new_tokens) != n or len(starts) != n:
            raise ValueError(f"extend takes 1 to {self.batch} rows, got {n}")
        s = state.max_len
        ends = [a + len(x) for a, x in zip(starts, new_tokens, strict=True)]
        if min(len(x) for x in new_tokens) < 1 or max(ends) > s:
            raise ValueError(f"each continuation needs 1 or more tokens ending by position {s}")
        t = min(length_bucket(max(len(x) for x in new_tokens), self.min_len), s)
        p = next_pow2(self.batch)
        tokens = np.full((p, t), self.pad_id, np.int32)
        lengths = np.ones(p, np.int32)
        start = np.zeros(p, np.int32)
        rows = np.zeros(p, np.int32)  # padding rows read slot 0 and are never inserted
        for i, (slot, x, a) in enumerate(zip(slots, new_tokens, starts, strict=True)):
            tokens[i, : len(x)], lengths[i], start[i], rows[i] = x, len(x), a, slot
        kv_len = doubling_bound(max(ends), self.kv_bucket, s)
        fn = self._compiled.get((p, t, kv_len))
        if fn is None:
            fn = jax.jit(scoped(partial(_extend, self.graphdef, kv_len), self.native))
            self._compiled[(p, t, kv_len)] = fn
        return fn(params, state, rows, tokens, start, lengths)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
