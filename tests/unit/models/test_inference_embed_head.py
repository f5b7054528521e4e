"""The engine's forward (a call with a KV cache) takes the embedding rows and the LM head as
the training forward does, without whole-table copies in its compiled program."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.checkpoints.hf_io import load_hf_checkpoint
from models.kv_cache import KVCache


@pytest.mark.parametrize("family", ["smollm2", "llama"])  # a tied head, an untied one
def test_cached_forward_takes_the_same_rows_and_head_without_table_copies(
    tiny_checkpoint, family
) -> None:
    """bf16 model: the rows taken as uint16 bits equal `jnp.take`'s exactly; the head's
    logits equal the product with `lm_head_weight()` in float32 within 1e-4; a compiled
    cached forward (a decode step's shape) holds no float32 copy of the [V, D] table and no
    transposed [D, V] copy of a tied one; its logits equal the cache-free forward's within
    0.05 (bf16 activations)."""
    cfg, model = load_hf_checkpoint(tiny_checkpoint(family), dtype="bfloat16")
    assert cfg.tie_word_embeddings == (family == "smollm2")
    V, D = cfg.vocab_size, cfg.hidden_size
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, size=(3, 5)), jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(model._embed(tokens, by_bits=True), np.float32),
        np.asarray(model._embed(tokens), np.float32),
    )
    h = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, D)), jnp.float32)
    want = jnp.einsum("btd,dv->btv", h.astype(jnp.bfloat16).astype(jnp.float32),
                      model.lm_head_weight().astype(jnp.float32))  # fmt: skip
    got = model.logits(h)
    assert got.shape == (3, 5, V) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)

    graphdef, params = nnx.split(model)
    cache = KVCache.init(cfg, 3, 8, bits=True)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (3, 5))

    def cached(params, tokens, cache):
        return nnx.merge(graphdef, params)(tokens, positions, cache)

    hlo = jax.jit(cached).lower(params, tokens, cache).compile().as_text()
    assert not re.search(rf"f32\[{V},{D}\]", hlo), "the table was converted to float32"
    assert not re.search(rf"bf16\[{D},{V}\]\{{1,0\}} (copy|fusion)", hlo), "a [D, V] copy"
    logits, _ = jax.jit(cached)(params, tokens, cache)
    free, _ = model(tokens, positions)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(free), atol=0.05, rtol=0)
