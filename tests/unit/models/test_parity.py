"""JAX decoder vs transformers on tiny random models of every family (fp32, 1e-4)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from models.checkpoints.hf_io import load_hf_checkpoint
from models.kv_cache import KVCache

LENGTHS = [12, 7, 3]
PAD = 3


def _batch(vocab: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.RandomState(1)
    rows = [rng.randint(4, vocab, size=n) for n in LENGTHS]
    tokens = np.full((len(rows), max(LENGTHS)), PAD, dtype=np.int32)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = row
    return tokens, rows


def test_logits_match_transformers_on_right_padded_batch(family_variant, tiny_checkpoint):
    family, variant = family_variant
    path = tiny_checkpoint(variant)
    cfg, model = load_hf_checkpoint(path)
    assert cfg.family == family
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, rows = _batch(cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, _ = model(jnp.asarray(tokens), positions)
    logits = np.asarray(logits)
    for b, row in enumerate(rows):
        with torch.no_grad():
            ref = hf(torch.tensor(row[None])).logits[0].numpy()
        got = logits[b, : len(row)]
        assert np.abs(got - ref).max() <= 1e-4, f"{variant} row {b}"
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("variant", ["llama", "qwen2", "gemma3"])
def test_prefill_then_decode_with_kv_cache_equals_full_forward(variant, tiny_checkpoint):
    cfg, model = load_hf_checkpoint(tiny_checkpoint(variant))
    tokens, rows = _batch(cfg.vocab_size)
    B, T = tokens.shape
    full_positions = jnp.broadcast_to(jnp.arange(T + 4, dtype=jnp.int32), (B, T + 4))
    extra = np.random.RandomState(2).randint(4, cfg.vocab_size, size=(B, 4)).astype(np.int32)
    # Reference: each row's own tokens followed by 4 decode tokens, no cache.
    lengths = np.array(LENGTHS)
    cache = KVCache.init(cfg, B, 32)
    prefill_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    _, cache = model(jnp.asarray(tokens), prefill_pos, cache)
    for step in range(4):
        pos = jnp.asarray(lengths + step, dtype=jnp.int32)[:, None]
        step_logits, cache = model(jnp.asarray(extra[:, step : step + 1]), pos, cache)
        for b, row in enumerate(rows):
            seq = np.concatenate([row, extra[b, : step + 1]])[None].astype(np.int32)
            ref, _ = model(jnp.asarray(seq), full_positions[:1, : seq.shape[1]])
            np.testing.assert_allclose(
                np.asarray(step_logits)[b, 0], np.asarray(ref)[0, -1], atol=1e-4, rtol=0
            )
