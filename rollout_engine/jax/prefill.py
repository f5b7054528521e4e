"""Prefill: one forward pass over a right-padded prompt batch, compiled once per shape bucket.

Legend: P prompts (padded to a power of two), T prompt length bucket (`length_bucket`: four
per doubling), V vocab, D model width.

After the seed write-up "Async RL in Pure JAX" (prefill bucketed to powers of two, so at most
log2(max_len) compilations per batch size, memoised; here four per doubling, so a bucket
pads less), with one change: the LM head runs on the
last real token of each prompt only, giving the logits of the first completion token, which the
slot substitution samples (G times per prompt, from one prefill).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.kernels.scope import scoped
from models.kv_cache import KVCache
from models.routing import hidden_with_routing


def next_pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two ``>= max(n, minimum)``."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def doubling_bound(need: int, smallest: int, cap: int) -> int:
    """The smallest ``smallest * 2**k >= need``, capped at `cap`; `cap` when `smallest` is 0
    (no bound). The decode call's attention and row bounds and an extension's attention bound
    (`BatcherConfig.kv_bucket`, ``row_bucket``): one compiled shape per bound."""
    if smallest <= 0:
        return cap
    bound = smallest
    while bound < need and bound < cap:
        bound *= 2
    return min(bound, cap)


def length_bucket(n: int, minimum: int = 1) -> int:
    """The prompt length bucket of ``n`` tokens: the smallest multiple of ``max(8, p // 8)``
    that is ``>= n`` and ``>= minimum`` (itself the smallest bucket), p the power of two
    ``>= n``: four buckets per doubling past 32 (16, 24, 32, 40, 48, 56, 64, 80, 96, 112,
    128, 160, 192, ...).

    A bucket pads at most a fifth of its length past 32 (powers of two alone: half), for
    four compiled shapes per doubling: the first 64 GSM8K prompts, prefilled 8 at a time
    shortest first (5,800 real tokens), pad to 6,528 positions, against 7,424 with the
    powers of two and their halfway points and 9,216 with the powers of two alone.
    """
    n = max(int(n), 1)
    step = max(8, next_pow2(n) // 8)
    return max(-(-n // step) * step, int(minimum))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillBatch:
    """A prefilled prompt batch, ready to be substituted into slots.

    Attributes:
        cache: per layer ``[P, K, T, H]`` (head-major, `models.kv_cache`); positions
            ``>= lengths[p]`` of row p hold garbage.
        last_logits: ``[P, V]`` float32, the logits after the last real token of each prompt.
        lengths: ``[P]`` int32, the prompt lengths (1 for padding rows).
        positions: ``[P, T]`` int32, the slot cache position of each of the T cache entries
            (an extension's window of new tokens, `extend.Extender`; the slot's capacity S
            for padding, which the insertion drops), or None: positions ``[0, T)``.
        routes: ``[P, T, L, k]`` int32, the experts each MoE layer's router chose for each
            prompt position (routing replay; a mixture-of-experts model's prefill), or None.
    """

    cache: KVCache
    last_logits: jax.Array
    lengths: jax.Array
    positions: jax.Array | None = None
    routes: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SharedPrefix:
    """The KV of a prompt prefix that several prompts share, computed once (one row).

    Attributes:
        cache: per layer ``[1, K, Tp, H]`` (head-major), Tp the prefix's `length_bucket`;
            positions ``>= length`` hold garbage (every suffix token overwrites or masks them).
        length: ``[]`` int32, the prefix's length in tokens (n0 <= Tp).
    """

    cache: KVCache
    length: jax.Array

    @property
    def bucket(self) -> int:
        """Tp, the prefix's cache positions (static)."""
        return int(self.cache.k[0].shape[2])


def _prefill(
    graphdef: nnx.GraphDef,
    cfg: ModelConfig,
    cache_dtype: str | None,
    kv_bits: bool,
    params: nnx.State,
    tokens: jax.Array,
    lengths: jax.Array,
    prefix: SharedPrefix | None = None,
) -> PrefillBatch:
    model = nnx.merge(graphdef, params)
    p, t = tokens.shape
    empty = KVCache.init(cfg, p, t, cache_dtype, bits=kv_bits)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (p, t))
    if prefix is not None:  # the suffixes at positions n0 onward, over the prefix's KV

        def behind(pre: jax.Array, new: jax.Array) -> jax.Array:  # [P, K, Tp + T, H]
            return jnp.concatenate([jnp.broadcast_to(pre, (p, *pre.shape[1:])), new], axis=2)

        empty = KVCache(
            k=tuple(map(behind, prefix.cache.k, empty.k)),
            v=tuple(map(behind, prefix.cache.v, empty.v)),
        )
        positions = positions + prefix.length
    routes = None
    with jax.named_scope("prefill"):
        if cfg.num_experts:  # record the routers' choices for routing replay
            hidden, cache, record = hidden_with_routing(model, tokens, positions, cache=empty)
            routes = record.expert_ids  # [P, T, L, k]
        else:
            hidden, cache = model.hidden(tokens, positions, empty)  # [P, T, D]
    last = hidden[jnp.arange(p), lengths - 1]  # [P, D]
    assert cache is not None  # a prefill given a cache returns it filled
    if prefix is not None:
        lengths = lengths + prefix.length
    return PrefillBatch(cache, model.logits(last), lengths, routes=routes)


class Prefiller:
    """Pads prompts into (P, T) buckets (P a power of two, T a `length_bucket`) and runs the
    compiled prefill of the bucket.

    Args:
        graphdef: ``nnx.split(decoder)[0]``. cfg: the model config.
        pad_id: token used for padding. min_len: smallest T bucket. max_len: largest T (a slot's
            cache length S; a bucket is clamped to it). batch: most prompts per call; every
            call is padded to P = next_pow2(batch) rows, so only T varies between compilations.
        out_sharding: optional sharding of every output (e.g. replicated over a data-parallel
            mesh, so that slot substitution finds each prompt on every device).
        cache_dtype: the KV dtype of the prefill's cache (the slots' cache dtype:
            `BatcherConfig.kv_cache_dtype`), None: ``cfg.dtype``. The prompt attends to its
            own keys and values as the cache holds them, so a later decode step sees the
            same values the prefill did.
        kv_bits: hold a bfloat16 prefill cache as uint16 bit patterns (`models.kv_cache`), as
            the slots' cache on CPU: its writes then run in place and the insertion copies
            the bits as they are. A bfloat16 cache otherwise cost XLA:CPU a float32
            round trip of each layer's [P, K, T, H] entry around its write: 80 ms of a
            1.5 s prefill of 8 prompts of 192 tokens at SmolLM2 bf16.
        native: trace inside `models.kernels.scope.native_scope` (the native CPU kernels
            where available; a one-device replica only).
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        cfg: ModelConfig,
        *,
        pad_id: int,
        min_len: int = 16,
        max_len: int,
        batch: int = 1,
        out_sharding: jax.sharding.Sharding | None = None,
        cache_dtype: str | None = None,
        kv_bits: bool = False,
        native: bool = False,
    ):
        self.graphdef, self.cfg, self.pad_id = graphdef, cfg, pad_id
        self.native = native
        self.cache_dtype, self.kv_bits = cache_dtype, kv_bits
        self.min_len, self.max_len = min_len, max_len
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.batch = batch
        self.out_sharding = out_sharding
        self._compiled: dict[tuple[int, int, int], Callable[..., PrefillBatch]] = {}

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """The (P, T) shapes compiled so far (each compiled exactly once; one compiled both
        alone and behind a `SharedPrefix` listed once; a shared prefix's own row P = 1)."""
        return sorted({(p, t) for p, t, _ in self._compiled})

    def pad(
        self, prompts: Sequence[Sequence[int]], batch: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Right-pad prompts into a bucket: ``tokens [P, T]`` int32 and ``lengths [P]`` int32,
        P = next_pow2(`batch`), by default the prefiller's ``batch``.

        Raises:
            ValueError: no prompts or more than `batch`, an empty prompt, or a prompt longer
                than ``max_len``.
        """
        batch = self.batch if batch is None else batch
        if not prompts or len(prompts) > batch:
            raise ValueError(f"prefill takes 1 to {batch} prompts, got {len(prompts)}")
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1:
            raise ValueError("every prompt needs at least one token, got an empty prompt")
        if max(lengths) > self.max_len:
            raise ValueError(
                f"a prompt has {max(lengths)} tokens, more than max_len={self.max_len}"
            )
        t = min(length_bucket(max(lengths), self.min_len), self.max_len)
        p = next_pow2(batch)
        tokens = np.full((p, t), self.pad_id, np.int32)
        lens = np.ones(p, np.int32)
        for i, prompt in enumerate(prompts):
            tokens[i, : len(prompt)] = np.asarray(prompt, np.int32)
            lens[i] = len(prompt)
        return tokens, lens

    def fits(self, prefix_len: int, suffixes: Sequence[Sequence[int]]) -> bool:
        """Whether ``suffixes`` prefill behind a shared prefix of `prefix_len` tokens within
        ``max_len`` cache positions (its bucket Tp plus the suffixes' T bucket)."""
        longest = max((len(x) for x in suffixes), default=0)
        tp = min(length_bucket(prefix_len, self.min_len), self.max_len)
        return longest >= 1 and tp + length_bucket(longest, self.min_len) <= self.max_len

    def __call__(
        self,
        params: nnx.State,
        prompts: Sequence[Sequence[int]],
        prefix: SharedPrefix | None = None,
        *,
        batch: int | None = None,
    ) -> PrefillBatch:
        """Prefill ``prompts`` (lists of token ids) with ``params``; row i is prompt i.

        With `prefix` (`shared_prefix`), ``prompts`` are the suffixes that follow its n0
        tokens: they run at positions n0 onward over its KV (attending to it as to their own
        earlier tokens), and row i of the result is the whole prompt: cache
        ``[P, K, Tp + T, H]`` (prefix then suffix; positions past ``lengths[i]`` garbage),
        ``lengths[i] = n0 + len(prompts[i])``. `batch`: see `pad`.

        Raises:
            ValueError: see `pad`; a prefix and suffixes that do not `fit`.
        """
        if prefix is not None and (
            prefix.bucket != min(length_bucket(int(prefix.length), self.min_len), self.max_len)
            or not self.fits(int(prefix.length), prompts)
        ):
            raise ValueError(
                f"a prefix of bucket {prefix.bucket} and suffixes of up to "
                f"{max(map(len, prompts), default=0)} tokens exceed max_len={self.max_len}"
            )
        tokens, lengths = self.pad(prompts, batch)
        shape = (*tokens.shape, 0 if prefix is None else prefix.bucket)
        fn = self._compiled.get(shape)
        if fn is None:
            body = scoped(
                partial(_prefill, self.graphdef, self.cfg, self.cache_dtype, self.kv_bits),
                self.native,
            )
            if self.out_sharding is None:
                fn = jax.jit(body)
            else:
                fn = jax.jit(body, out_shardings=self.out_sharding)
            self._compiled[shape] = fn
        if prefix is None:
            return fn(params, tokens, lengths)
        return fn(params, tokens, lengths, prefix)

    def shared_prefix(self, params: nnx.State, tokens: Sequence[int]) -> SharedPrefix:
        """The KV of ``tokens`` (n0 >= 1 of them, a prefix several prompts share) computed in
        one row, for `__call__`'s ``prefix``. The idea of vLLM's automatic prefix caching
        (a prefix's KV computed once, every prompt that starts with it prefilling only the
        rest), for the prompts of one prefill.

        Raises:
            ValueError: no tokens, or more than ``max_len``.
        """
        pre = self(params, [tokens], batch=1)  # one row, not a padded batch of copies
        return SharedPrefix(pre.cache, jnp.asarray(len(tokens), jnp.int32))
