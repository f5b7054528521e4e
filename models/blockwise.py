"""Blockwise causal attention for the cache-free forward (training, log-prob recomputation):
memory linear in the sequence length instead of quadratic.

The dense path (`models.layers.Attention`) materialises the scores of every query
against every key, [B, K, G, T, T] float32: at T = 16,384 and 32 heads that is 32 GiB per
sequence per layer. Here the queries are taken `block` at a time; for each query block a
`jax.lax.scan` runs over the key blocks it can see with the online softmax (a running max and
a running sum, rescaled as each key block arrives: Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax"; Rabe & Staats 2021, "Self-attention does not need O(n²)
memory"; the same recurrence as FlashAttention, Dao et al. 2022). Both loops are
`jax.lax.scan`s, so the program's size does not grow with T; each query block is
rematerialised in the backward pass (`jax.checkpoint`), so the step keeps O(T · block) of
scores alive instead of O(T²). Key blocks wholly above the diagonal are skipped
(`jax.lax.cond`: causal, half the work of the dense path), and so, on sliding-window layers,
are key blocks wholly below the window.

Skipping blocks by index is right because the rows' positions increase along T (every
training row is ``arange``, `trainer.batch.build_rl_batch`): a key with a larger index than
the query then has a larger position, and one `window` or more indices back is at least
`window` positions back. Within the blocks computed the mask is the dense path's, from the
positions (`scores.attention_mask`), so padding and any in-block structure are honoured.

Numerics: the products in the model dtype and the softmax in float32, as the dense path; the
result equals it up to the order of the float32 sums (about 1e-6 relative in fp32, measured in
`tests/unit/models/test_blockwise.py`).

Measured (`benchmarks/attention_memory.py`): see that script's last line for the temporary
bytes of one layer's forward and backward against the dense path's in the same run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.scores import attention_mask, attention_scores


def blockwise_attention(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    positions: jax.Array,
    cfg: ModelConfig,
    window: int | None,
    block: int,
) -> jax.Array:
    """Causal GQA attention of T queries over the same T tokens' keys, `block` at a time.

    Args:
        q: [B, T, K, G, H] queries (after rope), in the model dtype.
        keys, values: [B, T, K, H] in the model dtype.
        positions: [B, T] int32, increasing along T in every row (see the module docstring).
        cfg: the model config (`query_scale`, `attn_logit_softcap`, `dtype`).
        window: the sliding window of this layer (keys within `window` positions), or None.
        block: query and key block length (tokens), >= 1; T is padded up to a multiple of
            it with masked keys, and the padded queries' outputs are dropped.

    Returns:
        [B, T, K, G, H] in `values`' dtype, the dense path's "btkgh" layout. A query that
        sees no key at all (impossible for a query with position >= 0, which sees itself)
        gets zeros, where the dense path would average every key.

    Raises:
        ValueError: for a block below 1 or keys of another length than the queries.
    """
    if block < 1:
        raise ValueError(f"attention block must be >= 1 token; got {block}")
    B, T, K, G, H = q.shape
    if keys.shape[1] != T or values.shape[1] != T:
        raise ValueError(
            f"blockwise attention needs the queries' own keys: T={T}, keys {keys.shape[1]}"
        )
    nb = -(-T // block)
    pad = nb * block - T
    if pad:
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        keys = jnp.pad(keys, ((0, 0), (0, pad), (0, 0), (0, 0)))
        values = jnp.pad(values, ((0, 0), (0, pad), (0, 0), (0, 0)))
        positions = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=-1)

    def blocks(x: jax.Array) -> jax.Array:  # [B, nb·block, ...] -> [nb, B, block, ...]
        return jnp.moveaxis(x.reshape(B, nb, block, *x.shape[2:]), 1, 0)

    kb, vb, pb = blocks(keys), blocks(values), blocks(positions)
    body = jax.checkpoint(lambda carry, xs: _query_block(kb, vb, pb, cfg, window, block, xs))
    _, out = jax.lax.scan(body, None, (blocks(q), pb, jnp.arange(nb)))  # [nb, B, block, ...]
    out = jnp.moveaxis(out, 0, 1).reshape(B, nb * block, K, G, H).astype(values.dtype)
    return out[:, :T] if pad else out


def _query_block(
    kb: jax.Array,
    vb: jax.Array,
    pb: jax.Array,
    cfg: ModelConfig,
    window: int | None,
    block: int,
    xs: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[None, jax.Array]:
    """Query block i (qi [B, bq, K, G, H], q_pos [B, bq]) against the key blocks kb / vb
    [nb, B, bk, K, H] with positions pb [nb, B, bk], skipping (`jax.lax.cond`) those it cannot
    see; returns (None, [B, bq, K, G, H] float32)."""
    qi, q_pos, i = xs
    B, bq, K, G, H = qi.shape
    dt = cfg.dtype

    def attend(carry, k, v, k_pos):  # noqa: ANN001, ANN202
        m, denom, acc = carry  # [B, K, G, bq] x2, [B, K, G, bq, H] float32
        raw = jnp.einsum("btkgh,bskh->bkgts", qi, k).astype(jnp.float32)
        mask = attention_mask(q_pos, k_pos, window)[:, None, None]  # [B, 1, 1, bq, bk]
        s = attention_scores(raw, mask, cfg)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        denom = denom * scale + p.sum(axis=-1)
        pv = jnp.einsum("bkgts,bskh->bkgth", p.astype(dt), v)
        return m_new, denom, acc * scale[..., None] + pv.astype(jnp.float32)

    def over_keys(carry, blk):  # noqa: ANN001, ANN202
        k, v, k_pos, j = blk
        seen = j <= i  # causal: key blocks after the query block are hidden
        if window is not None:  # and those wholly `window` or more indices back
            seen &= (j + 1) * block > i * block - window + 1
        carry = jax.lax.cond(seen, attend, lambda c, *_: c, carry, k, v, k_pos)
        return carry, None

    init = (
        jnp.full((B, K, G, bq), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((B, K, G, bq), jnp.float32),
        jnp.zeros((B, K, G, bq, H), jnp.float32),
    )
    (_, denom, acc), _ = jax.lax.scan(over_keys, init, (kb, vb, pb, jnp.arange(kb.shape[0])))
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [B, K, G, bq, H]
    return None, jnp.transpose(out, (0, 3, 1, 2, 4))  # [B, bq, K, G, H]
