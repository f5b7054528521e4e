"""`models.layers.decode_attention` (one query per row over the head-major [B, K, S, H] cache)
and `dense_attention` over that cache (`head_major=True`, the prefill's) against the train
forward's dense path over the same keys in [B, S, K, H] order, in float32 and bf16."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.checkpoints.hf_io import load_hf_checkpoint
from models.layers import decode_attention, dense_attention
from models.scores import attention_mask

B, S = 5, 23


@pytest.mark.parametrize(
    ("dtype", "softcap", "window", "tol"),
    [("float32", None, None, 1e-6), ("float32", 30.0, 6, 1e-6),
     ("bfloat16", None, None, 2**-7), ("bfloat16", 30.0, 6, 2**-7)],
)  # fmt: skip
def test_decode_attention_equals_the_dense_path(tiny_checkpoint, dtype, softcap, window, tol):
    """5 rows at positions 0, 3, 11, 17, 22 of a 23-slot cache (slots past a row's position
    hold values that must stay unseen), 2 KV heads of 2 query heads each, with Gemma 2's soft
    cap and a sliding window: equal to the dense path within `tol` times the largest output
    (float32: summation order only; bf16: the two paths round probabilities and outputs to
    bf16 at different points, 2 ulp of 8 significant bits), and the bf16 cache's result is
    bf16."""
    cfg, _ = load_hf_checkpoint(tiny_checkpoint("llama"), dtype=dtype)
    cfg = dataclasses.replace(cfg, attn_logit_softcap=softcap)
    K, G, H = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    assert K >= 2 and G >= 2, "the tiny llama must have grouped heads for this test"
    rng = np.random.default_rng(0)
    dt = jnp.dtype(dtype)
    q = jnp.asarray(rng.normal(size=(B, 1, K, G, H)), dt)
    keys = jnp.asarray(rng.normal(size=(B, S, K, H)), dt)
    values = jnp.asarray(rng.normal(size=(B, S, K, H)), dt)
    positions = jnp.asarray([[0], [3], [11], [17], [22]], jnp.int32)  # [B, 1]
    slots = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    mask = attention_mask(positions, slots, window)  # [B, 1, S]

    keys_hm, values_hm = jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2)  # [B, K, S, H]
    got = jax.jit(lambda *a: decode_attention(*a, cfg))(q, keys_hm, values_hm, mask[:, 0])
    want = dense_attention(q, keys, values, mask, cfg)  # [B, 1, K, G, H]
    assert got.shape == (B, 1, K, G, H) and got.dtype == dt
    diff = jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))
    assert float(diff.max()) <= tol * max(1.0, float(jnp.abs(want.astype(jnp.float32)).max()))
    # the dense path over the head-major cache is the same products in the same order
    cached = dense_attention(q, keys_hm, values_hm, mask, cfg, head_major=True)
    np.testing.assert_allclose(
        np.asarray(cached, np.float32), np.asarray(want, np.float32), rtol=0, atol=1e-6
    )
    # row 0 sees slot 0 only: its output is that slot's values exactly (probability 1)
    first = jnp.broadcast_to(values[0, 0][:, None, :], (K, G, H))
    np.testing.assert_array_equal(np.asarray(got[0, 0]), np.asarray(first))
