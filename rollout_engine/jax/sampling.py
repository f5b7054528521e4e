"""Token sampling with temperature, top-k and top-p, returning the log-prob of each sampled token.

Legend: B batch (rows), V vocabulary.

The returned log-prob is the one the trainer's importance ratio needs: the log-probability of the
sampled token under the distribution it was actually drawn from, i.e. after the temperature and
after the top-k / top-p truncation and renormalisation (vLLM's
``logprobs_mode="processed_logprobs"``).
Order of the transforms follows vLLM's sampler: temperature, then top-k, then top-p.

`sample` takes one static `SamplingConfig` for the whole batch; `sample_rows` takes the settings
per row (`RowSampling`, values of the slot state), so one compiled engine serves greedy
evaluation and T=1 training in the same batch, each row drawn exactly as `sample` draws it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn; hashable, so it is a static argument of the compiled decode step.

    Attributes:
        temperature: divides the logits; ``0`` means greedy (argmax). Must be ``>= 0``.
        top_k: keep the ``top_k`` largest logits (all ties of the k-th value kept); ``<= 0`` is off.
        top_p: keep the smallest prefix of tokens, by descending probability, whose mass reaches
            ``top_p`` (the token that crosses ``top_p`` is kept, ties of its probability kept too);
            ``>= 1`` is off. Must be ``> 0``.

    With ``temperature == 0`` the token is the argmax of the raw logits and its log-prob is taken
    under the truncated distribution at temperature 1 (vLLM's convention for greedy requests).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not self.top_p > 0.0:
            raise ValueError(f"top_p must be > 0 (>= 1 = off), got {self.top_p}")
        if not isinstance(self.top_k, int):
            raise TypeError(f"top_k must be an int (<= 0 = off), got {type(self.top_k).__name__}")

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """True when a top-k or top-p filter is on (an engine started so compiles the filters
        in, and its requests may then set any top-k / top-p per slot)."""
        return self.top_k > 0 or self.top_p < 1.0


def truncate_logits(logits: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Set to ``-inf`` the logits that top-k and then top-p remove.

    Args:
        logits: ``[B, V]`` float, already divided by the temperature.
        top_k: keep logits ``>=`` the k-th largest of their row; ``<= 0`` (or ``>= V``) is off.
        top_p: keep, by descending probability, every token whose preceding mass (exclusive
            cumulative sum) is ``< top_p``, plus ties of the smallest kept probability; ``>= 1``
            is off. The most likely token is always kept.

    Returns:
        ``[B, V]`` float32 logits with the removed entries at ``-inf``.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    neg_inf = jnp.float32(-jnp.inf)
    if 0 < top_k < vocab:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits >= kth, logits, neg_inf)
    if top_p < 1.0:
        probs = jax.nn.softmax(logits, axis=-1)  # [B, V]
        desc = -jnp.sort(-probs, axis=-1)  # [B, V] descending
        before = jnp.cumsum(desc, axis=-1) - desc  # exclusive cumulative mass
        kept = before < top_p  # a prefix of the sorted row; position 0 is always kept
        n_kept = jnp.sum(kept, axis=-1, keepdims=True)  # [B, 1] >= 1
        floor = jnp.take_along_axis(desc, n_kept - 1, axis=-1)  # smallest kept probability
        logits = jnp.where(probs >= floor, logits, neg_inf)
    return logits


#: Tokens per block of `inverse_cdf_draw`'s two-level search.
CDF_BLOCK = 256


def inverse_cdf_draw(weights: jax.Array, uniforms: jax.Array) -> jax.Array:
    """Draw one token per row by inverting the cumulative distribution of `weights`, in two
    levels: the block of `CDF_BLOCK` tokens that holds the draw, then the token inside it.

    Token ``i`` is returned when ``cdf[i-1] <= u · cdf[V-1] < cdf[i]`` (``cdf`` the running sum
    of the row's weights), so it has probability ``w_i / sum(w)`` up to float32 rounding of the
    sums; a token of weight 0 (truncated) is never drawn, also when rounding puts the target at
    or past a block's or the row's end (the draw is then the last token of nonzero weight).
    One uniform per row instead of one Gumbel per vocabulary entry (``jax.random.categorical``).
    The search sums each block (one pass over the row), runs the cumulative sum over the
    ``V / CDF_BLOCK`` block sums and over the one block that holds the target only: XLA's CPU
    cumulative sum over whole rows is slow at a vocabulary's width (see `draw_logprob`).

    Args:
        weights: ``[B, V]`` float32 nonnegative, unnormalised probabilities (e.g.
            ``exp(logits - max)``), each row with a positive sum.
        uniforms: ``[B]`` float32 in [0, 1).

    Returns:
        ``[B]`` int32 tokens.
    """
    b, vocab = weights.shape
    blocks = -(-vocab // CDF_BLOCK)
    padded = jnp.pad(weights, ((0, 0), (0, blocks * CDF_BLOCK - vocab)))
    blocked = padded.reshape(b, blocks, CDF_BLOCK)  # [B, nb, blk]
    block_sums = jnp.sum(blocked, axis=-1)  # [B, nb]
    block_cdf = jnp.cumsum(block_sums, axis=-1)  # [B, nb]
    target = uniforms * block_cdf[:, -1]  # [B]
    j = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), _last_positive(block_sums))
    base = jnp.where(j > 0, jnp.take_along_axis(block_cdf, (j - 1)[:, None], axis=-1)[:, 0], 0.0)
    inner = jnp.take_along_axis(blocked, j[:, None, None], axis=1)[:, 0]  # [B, blk]
    inner_cdf = base[:, None] + jnp.cumsum(inner, axis=-1)
    i = jnp.minimum(jnp.sum(inner_cdf <= target[:, None], axis=-1), _last_positive(inner))
    return (j * CDF_BLOCK + i).astype(jnp.int32)


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` of ``x [B, V]`` as ``[B]`` int32 (the first index of the
    row's largest entry; of its first NaN if it has one), computed as a max, then the smallest
    index holding it: two single-operand reductions that XLA's CPU backend vectorises, where
    its argmax is one (value, index) reduction that it does not. SmolLM2's 49,152-entry rows,
    64 of them: 6.9 ms of a 100 ms decode step as ``jnp.argmax`` (a per-thunk trace,
    docs/benchmarks.md)."""
    v = x.shape[-1]
    index = jnp.arange(v, dtype=jnp.int32)
    top = jnp.max(x, axis=-1, keepdims=True)
    first_top = jnp.min(jnp.where(x == top, index, v), axis=-1)
    first_nan = jnp.min(jnp.where(jnp.isnan(x), index, v), axis=-1)
    return jnp.where(first_nan < v, first_nan, first_top).astype(jnp.int32)


def _last_positive(x: jax.Array) -> jax.Array:
    """``[B]`` int32 index of the last positive entry of each row of ``x [B, n]`` (0 if none)."""
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(x > 0, index, 0), axis=-1)


def draw_logprob(
    scaled: jax.Array, uniforms: jax.Array, greedy_tokens: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row from ``softmax(scaled)`` and return it with its log-prob.

    The log-prob is ``log_softmax(scaled)`` at the token, computed as `jax.nn.log_softmax`
    computes it (``shifted = scaled - max``, minus ``log(sum(exp(shifted)))``) but only at that
    token: no ``[B, V]`` log-prob array is made, which makes `sample_rows` several times
    faster on CPU than the full ``log_softmax``, its ``exp`` and one cumulative sum over each
    row (measured per decode step of 128 rows of SmolLM2's vocabulary).

    Args:
        scaled: ``[B, V]`` float32 logits divided by the temperature (and truncated: removed
            entries ``-inf``); each row has a finite entry.
        uniforms: ``[B]`` float32 in [0, 1).
        greedy_tokens: optional ``[B]`` int32 tokens that replace the draw where ``>= 0`` (the
            greedy rows' argmax; their log-prob is still taken under ``scaled``).

    Returns:
        ``(tokens [B] int32, logprobs [B] float32)``.
    """
    shifted = scaled - jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))
    weights = jnp.exp(shifted)  # [B, V]
    log_total = jnp.log(jnp.sum(weights, axis=-1))  # [B]
    tokens = inverse_cdf_draw(weights, uniforms)
    if greedy_tokens is not None:
        tokens = jnp.where(greedy_tokens >= 0, greedy_tokens, tokens)
    chosen = jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - log_total
    return tokens, chosen.astype(jnp.float32)


def sample(
    logits: jax.Array, keys: jax.Array, config: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row and return it with its log-prob under the sampling distribution.

    Args:
        logits: ``[B, V]`` float logits of the next token (raw LM-head output).
        keys: ``[B]`` typed PRNG keys (``jax.random.key``), one per row, so that a row's draw does
            not depend on which other rows share the batch. Ignored when greedy.
        config: the static sampling settings.

    Returns:
        ``(tokens [B] int32, logprobs [B] float32)``: ``logprobs[b] =
        log_softmax(truncate(logits[b] / T))[tokens[b]]`` (``T = 1`` when greedy).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    if keys.shape != logits.shape[:1]:
        raise ValueError(f"keys must be [B] = {logits.shape[:1]}, got shape {keys.shape}")
    temperature = 1.0 if config.greedy else config.temperature
    scaled = logits.astype(jnp.float32) / jnp.float32(temperature)
    truncated = truncate_logits(scaled, top_k=config.top_k, top_p=config.top_p)
    greedy = first_argmax(logits) if config.greedy else None
    return draw_logprob(truncated, jax.vmap(jax.random.uniform)(keys), greedy)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Sampling settings per row (slot), so requests with different settings share a batch.

    Attributes:
        temperature: ``[B]`` float32, ``0`` = greedy (argmax of the raw logits).
        top_k: ``[B]`` int32, ``<= 0`` (or ``>= V``) = off.
        top_p: ``[B]`` float32 in (0, 1], ``>= 1`` = off.

    Each row follows `SamplingConfig`'s semantics for its own values.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @staticmethod
    def filled(n: int, config: SamplingConfig) -> RowSampling:
        """``n`` rows all sampling with `config`."""
        return RowSampling(
            temperature=jnp.full(n, config.temperature, jnp.float32),
            top_k=jnp.full(n, config.top_k, jnp.int32),
            top_p=jnp.full(n, config.top_p, jnp.float32),
        )


def truncate_logits_rows(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`truncate_logits` with ``top_k [B]`` and ``top_p [B]`` per row (same rule per row; one
    descending sort serves both filters).

    Args:
        logits: ``[B, V]`` float, already divided by the temperature.

    Returns:
        ``[B, V]`` float32 logits with the removed entries at ``-inf``.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    neg_inf = jnp.float32(-jnp.inf)
    k_on = (top_k > 0) & (top_k < vocab)  # [B]
    sorted_logits = -jnp.sort(-logits, axis=-1)  # [B, V] descending
    kth = jnp.take_along_axis(sorted_logits, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
    logits = jnp.where(k_on[:, None] & (logits < kth), neg_inf, logits)
    p_on = top_p < 1.0  # [B]
    probs = jax.nn.softmax(logits, axis=-1)  # [B, V]
    desc = -jnp.sort(-probs, axis=-1)
    before = jnp.cumsum(desc, axis=-1) - desc
    kept = before < top_p[:, None]
    n_kept = jnp.sum(kept, axis=-1, keepdims=True)
    floor = jnp.take_along_axis(desc, n_kept - 1, axis=-1)
    return jnp.where(p_on[:, None] & (probs < floor), neg_inf, logits)


def sample_rows(
    logits: jax.Array, keys: jax.Array, rows: RowSampling, *, truncate: bool
) -> tuple[jax.Array, jax.Array]:
    """`sample` with the settings of each row: row b draws as ``sample`` would with
    ``SamplingConfig(rows.temperature[b], rows.top_k[b], rows.top_p[b])``, so one batch mixes
    greedy evaluation and T=1 training samples.

    Args:
        logits: ``[B, V]`` raw logits. keys: ``[B]`` typed PRNG keys (unused by greedy rows).
        rows: the per-row settings (``[B]`` each).
        truncate: static; False compiles the top-k / top-p filters out (then every row must have
            them off: the engine refuses requests that ask for one).

    Returns:
        ``(tokens [B] int32, logprobs [B] float32)``, each log-prob under its row's sampling
        distribution (greedy rows: the truncated distribution at temperature 1).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    if keys.shape != logits.shape[:1]:
        raise ValueError(f"keys must be [B] = {logits.shape[:1]}, got shape {keys.shape}")
    greedy = rows.temperature == 0.0  # [B]
    temperature = jnp.where(greedy, jnp.float32(1.0), rows.temperature.astype(jnp.float32))
    scaled = logits.astype(jnp.float32) / temperature[:, None]
    if truncate:
        scaled = truncate_logits_rows(scaled, rows.top_k, rows.top_p)
    argmax = jnp.where(greedy, first_argmax(logits), -1)
    return draw_logprob(scaled, jax.vmap(jax.random.uniform)(keys), argmax)
