"""HF -> JAX -> HF is bit-identical for every tensor; the exported folder loads in transformers."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mappings.apply import checkpoint_to_params, params_to_engine
from mappings.registry import (
    available_families,
    family_for_model_type,
    get_family,
    model_types,
)
from mappings.spec import MappingError
from models.checkpoints.hf_io import (
    CheckpointReader,
    load_hf_checkpoint,
    read_hf_config,
    save_hf_checkpoint,
)
from models.checkpoints.tiny import TINY_CONFIGS
from models.config import ModelConfig


def test_every_model_type_selects_a_family_file():
    table = model_types()
    assert set(table.values()) == set(available_families())
    for model_type, name in table.items():
        assert get_family(name).name == name, model_type
        assert family_for_model_type(model_type) == name
    with pytest.raises(MappingError, match="model_type 'bert' is not supported"):
        family_for_model_type("bert")


def test_every_family_has_a_tiny_checkpoint(family_variant):
    family, variant = family_variant
    assert variant is not None, f"{family}: no TINY_CONFIGS entry selects it"
    assert ModelConfig.from_hf({**TINY_CONFIGS[variant], "vocab_size": 64}).family == family


def test_hf_to_jax_to_hf_is_bit_identical(family_variant, tiny_checkpoint):
    name, variant = family_variant
    path = tiny_checkpoint(variant)
    cfg = ModelConfig.from_hf(read_hf_config(path))
    assert cfg.family == name
    family = get_family(name)
    reader = CheckpointReader(path)
    params = {r.jax: a for r, a in checkpoint_to_params(family, cfg, reader.read, reader.names())}
    back = dict(params_to_engine(family, cfg, params))
    assert set(back) == reader.names()
    for name, tensor in back.items():
        original = reader.read(name)
        assert tensor.dtype == original.dtype, name
        np.testing.assert_array_equal(tensor, original, err_msg=name)


@pytest.mark.parametrize("variant", ["qwen2", "gemma3"])
def test_exported_folder_loads_in_transformers_bit_identical(variant, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(variant)
    _, model = load_hf_checkpoint(path)
    out = save_hf_checkpoint(
        model, tmp_path / "export", hf_config=read_hf_config(path), tokenizer_from=path
    )
    original = load_file(str(path / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(original)
    for name in original:
        assert torch.equal(exported[name], original[name]), name
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 33, 65]])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ref(ids).logits)
    assert (out / "tokenizer.json").exists()


def test_padded_vocab_is_sliced_off_on_export(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    cfg = ModelConfig.from_hf(read_hf_config(path))
    family = get_family("llama")
    reader = CheckpointReader(path)
    padded = {"V": 384}
    params = {
        r.jax: a for r, a in checkpoint_to_params(family, cfg, reader.read, reader.names(), padded)
    }
    assert params["embed.embedding"].shape == (384, 64)
    assert params["lm_head.kernel"].shape == (64, 384)
    np.testing.assert_array_equal(params["embed.embedding"][320:], 0)
    back = dict(params_to_engine(family, cfg, params, padded))
    np.testing.assert_array_equal(back["lm_head.weight"], reader.read("lm_head.weight"))
