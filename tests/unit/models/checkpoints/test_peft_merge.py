"""`peft_io.merge_peft` (whole, and `only_adapted`) on a tiny llama with a LoRA on v and up: the
merged kernels equal `models.lora.merge_lora`'s (fp32, 1e-6), `only_adapted` returns exactly the
adapted kernels, the whole merge every base path with the rest shared, and a missing adapter
tensor is named."""

import jax
import numpy as np
import pytest
from flax import nnx

from models.checkpoints.peft_io import merge_peft, peft_tensors
from models.checkpoints.tiny import TINY_CONFIGS
from models.config import ModelConfig
from models.decoder import Decoder
from models.lora import add_lora, merge_lora
from models.params import flat_params

TARGETS = ("v_proj", "up_proj")
RANK, ALPHA = 2, 4.0


def _setup():
    cfg = ModelConfig.from_hf(dict(TINY_CONFIGS["llama"], vocab_size=64))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    base = flat_params(nnx.clone(model))
    add_lora(model, RANK, ALPHA, TARGETS, jax.random.key(3), b_init_std=0.1)
    tensors = dict(peft_tensors(flat_params(model), cfg, TARGETS))
    merge_lora(model)
    return cfg, base, tensors, flat_params(model)


def test_only_adapted_gives_the_adapted_kernels_equal_to_merge_lora() -> None:
    cfg, base, tensors, reference = _setup()
    kernels = merge_peft(base, cfg, tensors, TARGETS, ALPHA / RANK, only_adapted=True)
    layers = range(cfg.num_layers)
    assert set(kernels) == {f"layers.{i}.{p}.kernel" for i in layers for p in ("attn.v", "mlp.up")}
    for k, v in kernels.items():
        assert v.shape == base[k].shape and v.dtype == base[k].dtype
        np.testing.assert_allclose(np.asarray(v), np.asarray(reference[k]), rtol=0, atol=1e-6)
        assert not np.array_equal(np.asarray(v), np.asarray(base[k]))  # B != 0: it changed
    whole = merge_peft(base, cfg, tensors, TARGETS, ALPHA / RANK)
    assert set(whole) == set(base)
    for k in base:
        if k in kernels:
            np.testing.assert_array_equal(np.asarray(whole[k]), np.asarray(kernels[k]))
        else:
            assert whole[k] is base[k]  # shared, not copied


def test_a_missing_adapter_tensor_is_named() -> None:
    cfg, base, tensors, _ = _setup()
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    assert name in tensors
    del tensors[name]
    with pytest.raises(KeyError, match=r"layers\.1\.mlp\.up_proj\.lora_B"):
        merge_peft(base, cfg, tensors, TARGETS, ALPHA / RANK, only_adapted=True)
