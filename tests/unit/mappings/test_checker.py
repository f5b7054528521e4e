"""The checker passes on every family and names the tensor on deliberately broken mappings."""

import dataclasses

import numpy as np
import pytest

from mappings.__main__ import main
from mappings.check import check_folder
from mappings.families._base import LM_HEAD
from mappings.registry import get_family
from mappings.spec import Rule


def test_checker_passes_on_every_family(family_variant, tiny_checkpoint):
    family, variant = family_variant
    report = check_folder(get_family(family), tiny_checkpoint(variant), False)
    assert report.ok, report.lines()


def test_cli_exit_codes(tiny_checkpoint, capsys):
    assert main(["check", "--family", "qwen2", "--no-engine", str(tiny_checkpoint("qwen2"))]) == 0
    # qwen3 has no bias rules (llama maps q/k/v biases since it reads `attention_bias`)
    assert main(["check", "--family", "qwen3", "--no-engine", str(tiny_checkpoint("qwen2"))]) == 1
    out = capsys.readouterr().out
    assert "unmapped: model.layers.0.self_attn.q_proj.bias" in out


def test_missing_lm_head_rule_is_named(tiny_checkpoint):
    family = get_family("llama")
    broken = dataclasses.replace(family, rules=tuple(r for r in family.rules if r is not LM_HEAD))
    report = check_folder(broken, tiny_checkpoint("llama"), False)
    assert not report.ok
    assert "lm_head.weight" in report.unmapped


def test_wrong_transpose_is_named(tiny_checkpoint):
    family = get_family("llama")
    rules = tuple(
        Rule(r.jax, r.hf, r.hf_axes, "F D", r.tp_dim, r.fused, r.when)
        if r.jax.endswith("mlp.gate.kernel")
        else r
        for r in family.rules
    )
    report = check_folder(dataclasses.replace(family, rules=rules), tiny_checkpoint("llama"), False)
    assert not report.ok
    assert any(
        line.startswith("layers.0.mlp.gate.kernel: model (64, 96)")
        for line in report.shape_mismatch
    ), report.shape_mismatch


def test_tied_declared_on_separate_head_checkpoint(tiny_checkpoint):
    family = dataclasses.replace(get_family("llama"), tied=True)
    report = check_folder(family, tiny_checkpoint("llama"), False)
    assert report.unmapped == [
        "lm_head.weight (the mapping declares tied embeddings but the checkpoint has a "
        "separate head)"
    ]


def test_untied_declared_on_tied_checkpoint(tiny_checkpoint):
    family = dataclasses.replace(get_family("llama"), tied=False)
    report = check_folder(family, tiny_checkpoint("smollm2"), False)
    assert report.missing == [
        "lm_head.weight (for lm_head.kernel) (the mapping declares an untied head but the "
        "checkpoint ties it)"
    ]


@pytest.mark.vllm
@pytest.mark.slow
def test_checker_holds_mapping_against_vllm_names(tiny_checkpoint):
    report = check_folder(get_family("qwen3"), tiny_checkpoint("qwen3"), True)
    assert report.ok, report.lines()
    family = get_family("qwen3")
    rules = tuple(
        dataclasses.replace(r, fused=(r.fused[0].replace("gate_up_proj", "gate_proj"), "0"))
        if r.fused and "gate_up_proj" in r.fused[0]
        else r
        for r in family.rules
    )
    report = check_folder(dataclasses.replace(family, rules=rules), tiny_checkpoint("qwen3"), True)
    assert any(
        "model.layers.0.mlp.gate_proj.weight: fused into 'gate_proj'" in line
        for line in report.engine_mismatch
    ), report.engine_mismatch


def test_checkpoint_of_another_family_is_not_ok(tiny_checkpoint, capsys):
    # a Llama checkpoint held against qwen2's mapping: every tensor has a rule (qwen2's are
    # Llama's plus biases, which this config turns off), yet model_type selects llama
    assert main(["check", "--family", "qwen2", "--no-engine", str(tiny_checkpoint("llama"))]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "family_mismatch: config.json model_type 'llama' selects the llama family, not qwen2: "
        "check it with --family llama",
        "qwen2: 1 problem(s)",
    ]


def test_unmapped_bias_whose_condition_is_off_says_so(tmp_path, tiny_checkpoint):
    from safetensors.numpy import load_file, save_file

    model = tiny_checkpoint("llama")
    folder = tmp_path / "with_bias"
    folder.mkdir()
    tensors = {}
    for f in model.iterdir():
        if f.suffix == ".safetensors":
            tensors.update(load_file(f))
        else:
            (folder / f.name).write_bytes(f.read_bytes())
    width = tensors["model.layers.0.self_attn.q_proj.weight"].shape[0]
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(width, np.float32)
    save_file(tensors, folder / "model.safetensors")
    # a new Llama-named family that took qwen2's rules (biases under when="attention_bias"),
    # on a config.json without attention_bias
    family = dataclasses.replace(get_family("qwen2"), name="llama", model_types=("llama",))
    report = check_folder(family, folder, False)
    assert report.lines() == [
        "unmapped: model.layers.0.self_attn.q_proj.bias (rule layers.{layer}.attn.q.bias maps it "
        "only when 'attention_bias' holds, and this config.json turns 'attention_bias' off)"
    ]


def test_cli_prints_only_its_findings(tiny_checkpoint):
    """With the vLLM names check (vLLM imported): no platform note of vLLM's on stderr."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "mappings", "check", "--family", "llama", str(tiny_checkpoint())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, "llama: OK\n", "")
