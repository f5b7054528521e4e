"""Blockwise causal attention (`models.blockwise`) against the dense path: the model's
hidden states and their gradients on every family, and the function alone with Gemma 2's soft
cap, a sliding window across blocks, padding keys and a block that does not divide T."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.blockwise import blockwise_attention
from models.checkpoints.hf_io import load_hf_checkpoint
from models.layers import dense_attention
from models.params import flat_params
from models.scores import attention_mask
from trainer.train_step import ModelTemplate

T = 37  # not a multiple of any block below


def _dense(q, k, v, positions, cfg, window):
    """The dense path of `Attention` on [B, T, K, G, H] queries (no cache)."""
    return dense_attention(q, k, v, attention_mask(positions, positions, window), cfg)


@pytest.mark.parametrize("block", [5, 16, 64])
def test_model_hidden_and_grads_equal_the_dense_path(family_variant, tiny_checkpoint, block):
    """Every family (gemma3: sliding layers of window 4 next to full ones), 3 rows of 37
    tokens: hidden states within 2e-5 and parameter gradients within 2e-5 relative to the
    largest; a block of 64 >= T takes the dense path itself (equal bit for bit)."""
    _, variant = family_variant
    cfg, model = load_hf_checkpoint(tiny_checkpoint(variant))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, (3, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (3, T))
    weights = jnp.asarray(rng.normal(size=(3, T, cfg.hidden_size)), jnp.float32)
    params = flat_params(model)
    template = ModelTemplate(model)

    def loss(p, b):
        m = template.merge(p)
        h, _ = m.hidden(tokens, positions, attention_block=b)
        return jnp.sum(h * weights), h

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, dense), g_dense = grad(params, 0)
    (_, blk), g_blk = grad(params, block)
    if block >= T:
        np.testing.assert_array_equal(np.asarray(blk), np.asarray(dense))
    assert float(jnp.abs(blk - dense).max()) <= 2e-5 * max(1.0, float(jnp.abs(dense).max()))
    for name in g_dense:
        scale = max(1e-6, float(jnp.abs(g_dense[name]).max()))
        assert float(jnp.abs(g_blk[name] - g_dense[name]).max()) <= 2e-5 * scale, name


@pytest.mark.parametrize(
    ("window", "softcap", "block"),
    [(None, None, 4), (None, 50.0, 8), (6, None, 4), (3, 30.0, 5), (16, None, 8)],
)
def test_the_function_equals_the_dense_path(tiny_checkpoint, window, softcap, block):
    """Queries [2, 37, K 2, G 3, H 16] with Gemma 2's soft cap and windows shorter and longer
    than a block (key blocks wholly outside the window are skipped), every block size leaving
    a last block padded with masked keys (position -1): outputs within 1e-5, the padded
    queries' outputs dropped."""
    cfg, _ = load_hf_checkpoint(tiny_checkpoint("llama"))
    cfg = dataclasses.replace(cfg, attn_logit_softcap=softcap)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(k1, (2, T, 2, 3, 16)) * 3
    k = jax.random.normal(k2, (2, T, 2, 16)) * 3
    v = jax.random.normal(k3, (2, T, 2, 16))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    got = jax.jit(blockwise_attention, static_argnums=(4, 5, 6))(
        q, k, v, positions, cfg, window, block
    )
    want = _dense(q, k, v, positions, cfg, window)
    assert got.shape == want.shape == (2, T, 2, 3, 16)
    assert float(jnp.abs(got - want).max()) <= 1e-5


def test_bad_blocks_and_foreign_keys_are_refused(tiny_checkpoint):
    cfg, _ = load_hf_checkpoint(tiny_checkpoint("llama"))
    q = jnp.zeros((1, 8, 1, 1, 4))
    k = jnp.zeros((1, 8, 1, 4))
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    with pytest.raises(ValueError, match="block must be >= 1"):
        blockwise_attention(q, k, k, pos, cfg, None, 0)
    with pytest.raises(ValueError, match="needs the queries' own keys"):
        blockwise_attention(q, k[:, :4], k[:, :4], pos, cfg, None, 4)
