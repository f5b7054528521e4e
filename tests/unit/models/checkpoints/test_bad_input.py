"""A checkpoint that lacks a tensor, an unknown model_type, a dtype we cannot take."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from mappings.spec import MappingError
from models.checkpoints.hf_io import load_hf_checkpoint
from models.config import ModelConfig, UnsupportedModelError


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen2")
    shutil.copytree(src, tmp_path / "ckpt")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(
        MappingError, match=r"lacks tensors \['model.layers.1.mlp.down_proj.weight'\]"
    ):
        load_hf_checkpoint(tmp_path / "ckpt")


def test_unknown_model_type_lists_supported(tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint("llama"), tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["model_type"] = "mamba"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as err:
        load_hf_checkpoint(tmp_path / "ckpt")
    assert "model_type 'mamba' is not supported" in str(err.value)
    assert "'gemma3_text', 'llama', 'olmoe', 'qwen2', 'qwen3', 'qwen3_moe'" in str(err.value)


def test_unsupported_dtype_lists_supported(tiny_checkpoint):
    with pytest.raises(
        UnsupportedModelError,
        match=r"dtype='int8' is not supported; supported: "
        r"\['float32', 'bfloat16', 'float16'\]",
    ):
        load_hf_checkpoint(tiny_checkpoint("llama"), dtype="int8")


def test_unsupported_rope_type_is_named():
    with pytest.raises(UnsupportedModelError, match="rope_type 'yarn' is not supported"):
        ModelConfig.from_hf(
            {
                "model_type": "llama",
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
            }
        )


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        load_hf_checkpoint(tmp_path)
