"""Attention scores to probabilities, shared by every attention path (prefill and training in
`models.layers`, one-token decode, the blockwise path in `models.blockwise`):
the visibility mask from positions, scaling, Gemma 2's soft cap, the softmax.

Axis legend: B batch, T query length, S key length (cache slots).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """Boolean mask [B, T, S]: key slot s is visible to query t.

    q_pos: [B, T] int32 positions of the queries; k_pos: [B, S] int32 positions of the
    keys (-1 marks an empty slot). Causal (k <= q), and on sliding layers q - window < k.
    """
    q = q_pos[:, :, None]
    k = k_pos[:, None, :]
    mask = (k <= q) & (k >= 0)
    if sliding_window is not None:
        mask &= k > q - sliding_window
    return mask


def attention_scores(scores: jax.Array, mask: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Raw scores made ready for the softmax: scaled by `cfg.query_scale`, soft-capped
    (`cfg.attn_logit_softcap`, Gemma 2) and masked (float32 min where hidden).

    Args:
        scores: float32 raw q·k, any layout.
        mask: bool, broadcastable to `scores` (True = visible).
    """
    scores = scores * cfg.query_scale
    if cfg.attn_logit_softcap is not None:
        scores = jnp.tanh(scores / cfg.attn_logit_softcap) * cfg.attn_logit_softcap
    return jnp.where(mask, scores, jnp.finfo(jnp.float32).min)


def attention_probs(scores: jax.Array, mask: jax.Array, cfg: ModelConfig, axis: int) -> jax.Array:
    """Attention probabilities from raw scores (`attention_scores`), softmax over the key
    axis `axis`, cast to `cfg.dtype`.

    Args:
        scores: float32 raw q·k, any layout with the keys on `axis`.
        mask: bool, broadcastable to `scores` (True = visible).
    """
    return jax.nn.softmax(attention_scores(scores, mask, cfg), axis=axis).astype(cfg.dtype)
