"""Mixture-of-experts checkpoints that do not fit: a missing expert tensor, a config whose
expert count differs from the checkpoint's (fewer and more), a top-k larger than the expert
count, dense layers we do not take, and a malformed expert rule. Each a clear error."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from mappings.spec import MappingError, Rule
from models.checkpoints.hf_io import load_hf_checkpoint
from models.config import ModelConfig, UnsupportedModelError


def _copy(tiny_checkpoint, tmp_path, variant="qwen3_moe", **config_changes):
    src = tiny_checkpoint(variant)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_missing_expert_tensor_is_named(tiny_checkpoint, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path, "olmoe")
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(
        MappingError, match=r"lacks tensors \['model.layers.1.mlp.experts.3.up_proj.weight'\]"
    ):
        load_hf_checkpoint(dst)


def test_config_with_more_experts_than_the_checkpoint_names_the_missing(tiny_checkpoint, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path, num_experts=9)  # the checkpoint holds 8
    with pytest.raises(MappingError) as err:
        load_hf_checkpoint(dst)
    assert "model.layers.0.mlp.experts.8.gate_proj.weight" in str(err.value)
    assert "experts.7." not in str(err.value)


def test_config_with_fewer_experts_than_the_checkpoint_is_refused(tiny_checkpoint, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path, num_experts=6)  # the router has 8 rows too
    with pytest.raises(MappingError) as err:
        load_hf_checkpoint(dst)
    text = str(err.value)
    assert "checkpoint holds experts the config does not (num_experts=6)" in text
    assert "(12 tensors)" in text  # experts 6 and 7: 3 tensors each, 2 layers


def test_top_k_above_the_expert_count_is_refused(tiny_checkpoint, tmp_path):
    dst = _copy(tiny_checkpoint, tmp_path, "olmoe", num_experts_per_tok=5)  # 4 experts
    with pytest.raises(
        UnsupportedModelError, match=r"num_experts_per_tok=5 must be between 1 and num_experts=4"
    ):
        load_hf_checkpoint(dst)


@pytest.mark.parametrize(
    "change", [{"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}], ids=["mlp_only", "step"]
)
def test_qwen3_moe_with_dense_layers_is_refused(tiny_checkpoint, change):
    config = json.loads((tiny_checkpoint("qwen3_moe") / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="every layer must be a mixture of experts"):
        ModelConfig.from_hf({**config, **change})


def test_olmoe_clip_qkv_is_refused(tiny_checkpoint):
    config = json.loads((tiny_checkpoint("olmoe") / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="olmoe with clip_qkv is not supported"):
        ModelConfig.from_hf({**config, "clip_qkv": 8.0})


def test_expert_rule_must_stack_experts_first():
    with pytest.raises(MappingError, match="an \\{expert\\} rule's jax_axes must start with 'E'"):
        Rule(
            "layers.{layer}.mlp.experts.up.kernel",
            "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
            "M D",
            "D E M",
        )
