"""`python -m trainer export` of a LoRA run (tiny SmolLM2-shaped model, fp32, rank 4 on every
projection, a non-zero adapter): the merged folder loads in transformers alone and the PEFT
adapter folder loads in transformers + peft onto the base, both with the logits of our model
with the adapter within 1e-4; `--adapter` of a run without LoRA is a clear error."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from models.checkpoints.hf_io import load_hf_checkpoint
from models.sharding import make_mesh
from trainer.__main__ import main
from trainer.build import train_step_from_config
from trainer.checkpointing import Checkpointer, Progress
from trainer.launch.job import _plain
from trainer.launch.job_config import load_job_config
from trainer.launch.model_source import resolve_model

TOL = 1e-4


def _saved_run(tmp_path, overrides):
    """A run folder with config.yaml and a step-2 checkpoint; returns (run_dir, step, state)."""
    run_dir = tmp_path / "run"
    job = load_job_config(None, ["model.path=tiny:smollm2", f"run_dir={run_dir}", *overrides])
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(_plain(job), sort_keys=False))
    _, model = load_hf_checkpoint(resolve_model("tiny:smollm2", 0))
    step = train_step_from_config(job.run, model, make_mesh(1, 1, devices=jax.devices()[:1]))
    state = step.init_state(model, step=2)
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        ckpt.save(state, Progress(2, 0, 2, jax.random.key(0)))
    return run_dir, step, state


def test_lora_export_merged_and_peft_adapter_match_our_logits(tmp_path, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("JAXRL_CACHE_DIR", str(tmp_path / "cache"))
    run_dir, step, state = _saved_run(
        tmp_path, ["lora.rank=4", "lora.alpha=8", "lora.init_b_std=0.05"]
    )
    ids = [1, 5, 9, 33, 2, 17, 8, 40, 3]
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    ours = np.asarray(step.model(state)(jnp.asarray([ids], jnp.int32), positions)[0])[0]
    base = resolve_model("tiny:smollm2", 0)
    _, base_model = load_hf_checkpoint(base)
    base_logits = np.asarray(base_model(jnp.asarray([ids], jnp.int32), positions)[0])[0]
    assert np.abs(ours - base_logits).max() > 1e-3  # the adapter changes the model

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert main(["export", str(run_dir), str(merged)]) == 0
    assert main(["export", str(run_dir), str(adapter), "--adapter"]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert len(config["target_modules"]) == 7

    tokens = torch.tensor([ids])
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(tokens).logits[0].numpy()
    np.testing.assert_allclose(theirs, ours, atol=TOL)

    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf_base, adapter).eval()
    with torch.no_grad():
        theirs = with_adapter(tokens).logits[0].numpy()
    np.testing.assert_allclose(theirs, ours, atol=TOL)


def test_adapter_export_of_a_run_without_lora_is_a_clear_error(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("JAXRL_CACHE_DIR", str(tmp_path / "cache"))
    run_dir, _, _ = _saved_run(tmp_path, [])
    assert main(["export", str(run_dir), str(tmp_path / "a"), "--adapter"]) == 2
    assert "no LoRA adapter to export" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
