"""Log-probabilities of target tokens from final hidden states and the LM head.

Legend: N rows (B * T flattened), D model width, V vocabulary, C chunk size, K number of chunks.

`fused_target_logprobs` never materialises the [N, V] logits: it scans over K chunks of C rows,
computing [C, V] logits at a time, and its custom VJP recomputes them chunk by chunk in the
backward pass (the "fused linear selection" of the seed write-up "Async RL in Pure JAX",
section "Memory Optimization"; the same idea as Liger's fused linear cross-entropy and Apple's
Cut Cross-Entropy, Wijmans et al. 2024). The forward saves only the [N] log-sum-exp.

Logits are z = s(h W) / tau, with s the optional soft-cap s(x) = cap * tanh(x / cap) (Gemma 2/3's
``final_logit_softcapping``) applied before the temperature, as vLLM does (the model computes
capped logits, the sampler divides by the temperature). Gradients, with
l_i = z_{i, y_i} - logsumexp(z_i), incoming cotangent g_i and a = h W:

    dz_i = g_i (onehot(y_i) - softmax(z_i)),   da = dz s'(a) / tau,   s'(a) = 1 - tanh(a / cap)^2
    dh = da W^T,   dW = sum over chunks of h^T da

With top-k / top-p (the engines' sampling truncation), the logits of each row outside the kept
set of `trainer.truncation.keep_mask` (the engines' rule; the target always kept) are -inf
before the log-sum-exp, so l_i is the log-prob under the truncated, renormalised distribution
and softmax(z_i) is 0 outside the set in the backward pass (the set itself has no gradient).

The LM head runs in float32 at the highest matmul precision whatever the input dtype (the seed's
advice: the log-probs feed an importance ratio, where bf16 rounding shows up directly).

Chunks take rows with a stride, chunk k holding rows {c * K + k}: when the N rows are sharded in
contiguous blocks over devices, the reshape [N, D] -> [C, K, D] keeps the sharding on C, so every
device works on every scan step without an all-to-all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from trainer.truncation import keep_mask, truncation_active

_HIGHEST = jax.lax.Precision.HIGHEST


def _check(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    temperature: float,
    softcap: float | None,
    top_p: float = 1.0,
) -> None:
    if hidden.ndim < 2:
        raise ValueError(f"hidden must be [..., D]; got shape {hidden.shape}")
    if w.ndim != 2 or w.shape[0] != hidden.shape[-1]:
        raise ValueError(f"w must be [D={hidden.shape[-1]}, V]; got shape {w.shape}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets must be {hidden.shape[:-1]} (hidden[..., 0]); got {targets.shape}"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be an integer array; got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None; got {softcap}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1]; got {top_p}")


def _truncate(z: jax.Array, y: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """[C, V] logits with the entries the engines' truncation removes at -inf (no-op if off)."""
    if not truncation_active(top_k, top_p, z.shape[-1]):
        return z
    return jnp.where(keep_mask(z, y, top_k=top_k, top_p=top_p), z, -jnp.inf)


def naive_target_logprobs(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> jax.Array:
    """Reference path: full [..., V] float32 logits, truncation, log-softmax, gather.

    Args:
      hidden: [..., D] final hidden states (after the final norm), any float dtype.
      w: [D, V] LM head.
      targets: [...] int token ids in [0, V).
      temperature: logits are divided by it (> 0), matching the sampling distribution.
      softcap: if set, logits are cap * tanh(logits / cap) before the temperature.
      top_k, top_p: the engines' truncation (`trainer.truncation.keep_mask`; 0 and 1 are off).

    Returns:
      [...] float32 log-probabilities of `targets`.

    Raises:
      ValueError: on mismatched shapes, non-integer targets, temperature <= 0, softcap <= 0 or
        top_p outside (0, 1].
    """
    _check(hidden, w, targets, temperature, softcap, top_p)
    logits = jnp.einsum(
        "...d,dv->...v", hidden.astype(jnp.float32), w.astype(jnp.float32), precision=_HIGHEST
    )
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    z = logits / temperature
    flat = _truncate(z.reshape(-1, z.shape[-1]), targets.reshape(-1), top_k, top_p)
    logp = jax.nn.log_softmax(flat.reshape(z.shape), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def _chunked(x: jax.Array, chunk: int, num_chunks: int) -> jax.Array:
    """[N, ...] -> [K, C, ...] with strided rows (chunk k holds rows c * K + k), zero-padded."""
    pad = chunk * num_chunks - x.shape[0]
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    x = x.reshape(chunk, num_chunks, *x.shape[1:])  # [C, K, ...]
    return jnp.swapaxes(x, 0, 1)  # [K, C, ...]


def _unchunked(x: jax.Array, n: int) -> jax.Array:
    """Inverse of `_chunked`: [K, C, ...] -> [N, ...]."""
    x = jnp.swapaxes(x, 0, 1)  # [C, K, ...]
    return x.reshape(-1, *x.shape[2:])[:n]


def _layout(n: int, chunk_size: int) -> tuple[int, int]:
    chunk = min(chunk_size, n)
    return chunk, -(-n // chunk)


def _chunk_logits(
    h: jax.Array, w32: jax.Array, temperature: float, softcap: float | None
) -> tuple[jax.Array, jax.Array | None]:
    """[C, D] x [D, V] -> ([C, V] float32 logits z, tanh(a / cap) or None), see module doc."""
    a = jnp.matmul(h.astype(jnp.float32), w32, precision=_HIGHEST)  # [C, V]
    if softcap is None:
        return a / temperature, None
    t = jnp.tanh(a / softcap)
    return softcap * t / temperature, t


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _fused(
    h, w, y, chunk_size: int, temperature: float, softcap: float | None, top_k: int, top_p: float
):
    return _fused_fwd(h, w, y, chunk_size, temperature, softcap, top_k, top_p)[0]


def _fused_fwd(h, w, y, chunk_size, temperature, softcap, top_k, top_p):
    n = h.shape[0]
    chunk, num_chunks = _layout(n, chunk_size)
    w32 = w.astype(jnp.float32)

    def body(carry, xs):
        h_c, y_c = xs  # [C, D], [C]
        z, _ = _chunk_logits(h_c, w32, temperature, softcap)  # [C, V]
        z = _truncate(z, y_c, top_k, top_p)
        lse = jax.nn.logsumexp(z, axis=-1)  # [C]
        z_y = jnp.take_along_axis(z, y_c[:, None], axis=-1)[:, 0]  # [C]
        return carry, (z_y - lse, lse)

    xs = (_chunked(h, chunk, num_chunks), _chunked(y, chunk, num_chunks))
    _, (logp, lse) = jax.lax.scan(body, None, xs)  # [K, C] each
    return _unchunked(logp, n), (h, w, y, _unchunked(lse, n))


def _fused_bwd(chunk_size, temperature, softcap, top_k, top_p, residuals, g):
    h, w, y, lse = residuals
    n = h.shape[0]
    chunk, num_chunks = _layout(n, chunk_size)
    w32 = w.astype(jnp.float32)

    def body(dw, xs):
        h_c, y_c, lse_c, g_c = xs  # [C, D], [C], [C], [C]
        z, t = _chunk_logits(h_c, w32, temperature, softcap)  # [C, V]
        z = _truncate(z, y_c, top_k, top_p)  # softmax is 0 outside the kept set
        dz = -g_c[:, None] * jnp.exp(z - lse_c[:, None])  # [C, V]: -g * softmax
        dz = dz.at[jnp.arange(dz.shape[0]), y_c].add(g_c)  # + g * onehot(y)
        dz = dz / temperature  # now d loss / d a, up to the soft-cap factor
        if t is not None:
            dz = dz * (1.0 - t * t)
        dh_c = jnp.matmul(dz, w32.T, precision=_HIGHEST)  # [C, D]
        dw = dw + jnp.matmul(h_c.astype(jnp.float32).T, dz, precision=_HIGHEST)  # [D, V]
        return dw, dh_c

    xs = tuple(
        _chunked(a, chunk, num_chunks) for a in (h, y, lse, g.astype(jnp.float32))
    )  # padded rows carry g = 0 and so add nothing
    dw, dh = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs)
    dy = jnp.zeros(y.shape, jax.dtypes.float0)
    return _unchunked(dh, n).astype(h.dtype), dw.astype(w.dtype), dy


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_target_logprobs(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    chunk_size: int = 1024,
    top_k: int = 0,
    top_p: float = 1.0,
) -> jax.Array:
    """Log-probs of `targets` under softmax(hidden @ w / temperature), in chunks of rows.

    Equal to `naive_target_logprobs` (to float32 rounding) with peak extra memory
    O(chunk_size * V) instead of O(N * V), in the forward and the backward pass; differentiable
    with respect to `hidden` and `w` (custom VJP, see the module docstring).

    Args:
      hidden: [..., D] final hidden states (after the final norm), any float dtype; leading
        dimensions (e.g. [B, T]) are flattened to N rows.
      w: [D, V] LM head (for tied embeddings, the embedding table transposed).
      targets: [...] int token ids in [0, V) (not checked inside jit: an out-of-range id gives
        an undefined value).
      temperature: logits are divided by it (> 0, a Python float), so the result matches the
        engine's processed (post-temperature) log-probs.
      softcap: the model's final logit soft-cap (``cfg.final_logit_softcap``), or None.
      chunk_size: rows per scan step C (a Python int >= 1); N need not be a multiple of it.
      top_k, top_p: the engines' sampling truncation (Python int / float; 0 and 1 are off):
        the log-probs are under the truncated, renormalised distribution (module docstring).

    Returns:
      [...] float32 log-probabilities, the shape of `targets`.

    Raises:
      ValueError: on mismatched shapes, non-integer targets, temperature <= 0, softcap <= 0,
        top_p outside (0, 1] or chunk_size < 1.
    """
    _check(hidden, w, targets, temperature, softcap, top_p)
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    lead = targets.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])  # [N, D]
    y1 = targets.reshape(-1).astype(jnp.int32)  # [N]
    if h2.shape[0] == 0:
        return jnp.zeros(lead, jnp.float32)
    cap = None if softcap is None else float(softcap)
    out = _fused(h2, w, y1, int(chunk_size), float(temperature), cap, int(top_k), float(top_p))
    return out.reshape(lead)
