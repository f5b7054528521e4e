"""LoRA adapters (`models.lora`) on a tiny random Llama-shaped decoder, fp32: a fresh adapter
(B = 0) leaves the logits bit-identical; a non-zero one equals the merged weights
W + (alpha / r) A B and PEFT's unmerged x W + (alpha / r) (x A) B; the faults."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.checkpoints.tiny import TINY_CONFIGS
from models.config import ModelConfig
from models.decoder import Decoder
from models.lora import TARGETS, add_lora, merge_lora
from models.params import flat_params

T = 9
ALL = tuple(TARGETS)


def _model(variant: str = "llama") -> Decoder:
    cfg = ModelConfig.from_hf(
        dict(TINY_CONFIGS[variant], vocab_size=64, max_position_embeddings=64)
    )
    return Decoder(cfg, rngs=nnx.Rngs(0))


def _inputs(vocab: int) -> tuple[jax.Array, jax.Array]:
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, vocab, (2, T)), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))


def test_zero_b_leaves_logits_bit_identical():
    model = _model()
    tokens, positions = _inputs(model.cfg.vocab_size)
    base = np.asarray(model(tokens, positions)[0])
    add_lora(model, rank=4, alpha=8.0, targets=ALL, key=jax.random.key(1))
    a = np.asarray(model.layers[0].attn.q.lora_a[...])
    assert a.shape == (model.cfg.hidden_size, 4) and np.abs(a).max() > 0
    assert np.abs(a).max() <= 1 / np.sqrt(model.cfg.hidden_size)  # kaiming-uniform bound
    np.testing.assert_array_equal(np.asarray(model(tokens, positions)[0]), base)


def test_nonzero_b_equals_merged_weights_and_unmerged_forward():
    model = _model()
    tokens, positions = _inputs(model.cfg.vocab_size)
    base_params = flat_params(model)
    rank, alpha = 4, 8.0
    add_lora(model, rank, alpha, ALL, jax.random.key(1), b_init_std=0.05)
    adapted = np.asarray(model(tokens, positions)[0])
    assert np.abs(adapted - np.asarray(_model()(tokens, positions)[0])).max() > 1e-3

    # The merged kernels, checked against W + (alpha/r) A B computed here in float64.
    merged = nnx.clone(model)
    merge_lora(merged)
    params = flat_params(merged)
    assert not any("lora" in p for p in params)
    o = model.layers[1].attn.o
    want = np.asarray(base_params["layers.1.attn.o.kernel"], np.float64) + (alpha / rank) * (
        np.asarray(o.lora_a[...], np.float64) @ np.asarray(o.lora_b[...], np.float64)
    ).reshape(o.kernel.shape)
    np.testing.assert_allclose(np.asarray(params["layers.1.attn.o.kernel"]), want, atol=1e-7)
    np.testing.assert_allclose(np.asarray(merged(tokens, positions)[0]), adapted, atol=1e-6)

    # PEFT's unmerged form on one projection: x W + s (x A) B, W as HF's [in, out] view.
    q = model.layers[0].attn.q
    x = np.random.default_rng(2).normal(size=(3, model.cfg.hidden_size))
    w = np.asarray(base_params["layers.0.attn.q.kernel"], np.float64).reshape(x.shape[1], -1)
    peft = x @ w + (alpha / rank) * (x @ np.asarray(q.lora_a[...])) @ np.asarray(q.lora_b[...])
    ours = x @ np.asarray(q.weight("float32"), np.float64).reshape(x.shape[1], -1)
    np.testing.assert_allclose(ours, peft, atol=1e-6)


def test_only_the_chosen_targets_get_adapters():
    model = _model()
    add_lora(model, 2, 4.0, ("q_proj", "down_proj"), jax.random.key(0))
    names = sorted(p for p in flat_params(model) if "lora" in p)
    L = model.cfg.num_layers
    assert len(names) == 4 * L
    assert all(".attn.q.lora_" in n or ".mlp.down.lora_" in n for n in names)
    assert model.layers[0].mlp.down.lora_b[...].shape == (2, model.cfg.hidden_size)


def test_faults():
    model = _model()
    with pytest.raises(ValueError, match="rank must be >= 1"):
        add_lora(model, 0, 1.0, ALL, jax.random.key(0))
    with pytest.raises(ValueError, match="unknown"):
        add_lora(model, 2, 1.0, ("qkv",), jax.random.key(0))
    with pytest.raises(ValueError, match="unknown"):
        add_lora(model, 2, 1.0, (), jax.random.key(0))
    add_lora(model, 2, 1.0, ("q_proj",), jax.random.key(0))
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        add_lora(model, 2, 1.0, ("q_proj",), jax.random.key(0))
    moe = [v for v, c in TINY_CONFIGS.items() if c.get("num_experts") or c.get("num_local_experts")]
    if moe:
        with pytest.raises(ValueError, match="no gate_proj to adapt"):
            add_lora(_model(moe[0]), 2, 1.0, ("gate_proj",), jax.random.key(0))


def test_engine_params_are_the_merged_kernels_without_adapters():
    from models.lora import engine_params
    from trainer.publish.host_views import flat_of

    model = _model()
    plain = flat_params(model)
    assert all(engine_params(model)[k] is v for k, v in plain.items())  # no copy without LoRA
    add_lora(model, 2, 4.0, ("v_proj", "up_proj"), jax.random.key(3), b_init_std=0.1)
    pushed = flat_of(model)
    assert sorted(pushed) == sorted(plain)
    merged = nnx.clone(model)
    merge_lora(merged)
    for k, v in flat_params(merged).items():
        np.testing.assert_array_equal(np.asarray(pushed[k]), np.asarray(v), err_msg=k)
    changed = {k for k in plain if not np.array_equal(np.asarray(pushed[k]), np.asarray(plain[k]))}
    L = model.cfg.num_layers
    assert changed == {f"layers.{i}.{p}.kernel" for i in range(L) for p in ("attn.v", "mlp.up")}


def test_scanned_layers_with_remat_carry_the_adapters():
    model = _model()
    add_lora(model, 4, 8.0, ALL, jax.random.key(1), b_init_std=0.05)
    tokens, positions = _inputs(model.cfg.vocab_size)
    scanned = model.logits(model.hidden(tokens, positions, scan_layers=True, remat="full")[0])
    looped = model.logits(model.hidden(tokens, positions)[0])
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(looped), atol=1e-5)
