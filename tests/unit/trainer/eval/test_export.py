"""`python -m trainer export`: a training checkpoint of the smoke model becomes an HF folder whose
transformers logits equal the trainer's (same params) within 1e-5."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from models.checkpoints.hf_io import load_hf_checkpoint
from models.params import model_from_params
from models.sharding import make_mesh
from trainer.__main__ import main
from trainer.build import train_step_from_config
from trainer.checkpointing import Checkpointer, Progress
from trainer.eval.export import locate_checkpoint
from trainer.launch.job import _plain
from trainer.launch.job_config import load_job_config
from trainer.launch.model_source import resolve_model


def test_export_matches_the_trainers_logits(tmp_path, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("JAXRL_CACHE_DIR", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    job = load_job_config(None, ["model.path=tiny:smollm2", f"run_dir={run_dir}"])
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(_plain(job), sort_keys=False))
    base = resolve_model("tiny:smollm2", 0)
    cfg, model = load_hf_checkpoint(base)
    step = train_step_from_config(job.run, model, make_mesh(1, 1, devices=jax.devices()[:1]))
    state = step.init_state(model, step=3)
    moved = {k: v + 0.01 * jnp.sin(jnp.arange(v.size).reshape(v.shape)) for k, v in
             state.params.items()}  # fmt: skip  # "trained": every param differs from the base
    state = type(state)(moved, state.opt_state, state.step)
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        ckpt.save(state, Progress(step=3, data_position=0, weight_version=3,
                                  rng=jax.random.key(0)))  # fmt: skip
    out = tmp_path / "hf"
    assert main(["export", str(run_dir / "checkpoints" / "3"), str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template  # the chat template travels with the tokenizer
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
        return_dict=False,
    )  # fmt: skip
    trained = model_from_params(cfg, moved)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    ours, _ = trained(jnp.asarray([ids], jnp.int32), positions, None)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(np.asarray(ours)[0] - theirs).max() < 1e-5
    base_logits, _ = model(jnp.asarray([ids], jnp.int32), positions, None)
    assert np.abs(np.asarray(base_logits)[0] - theirs).max() > 1e-3  # not the base weights
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert locate_checkpoint(run_dir) == (run_dir, None)


def test_export_of_a_folder_without_a_run_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "expected a run folder (config.yaml, checkpoints/)" in capsys.readouterr().err


def test_eval_of_a_run_exports_each_step_once_and_names_the_run_and_step(
    tmp_path, monkeypatch
) -> None:
    from trainer.eval.export import export_once
    from trainer.eval.run import _model_folder

    monkeypatch.setenv("JAXRL_CACHE_DIR", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    job = load_job_config(None, ["model.path=tiny:smollm2", f"run_dir={run_dir}"])
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(_plain(job), sort_keys=False))
    _, model = load_hf_checkpoint(resolve_model("tiny:smollm2", 0))
    step = train_step_from_config(job.run, model, make_mesh(1, 1, devices=jax.devices()[:1]))
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        for s in (2, 4):
            ckpt.save(step.init_state(model, step=s), Progress(s, 0, s, jax.random.key(0)))

    folder, run, newest = export_once(run_dir)
    assert (folder, run, newest) == (run_dir / "exports" / "4", run_dir, 4)
    written = (folder / "model.safetensors").stat()
    # a second evaluation of the run (another --out) reuses the export: nothing is rewritten
    eval_job = load_job_config(None, [f"model.path={run_dir}", f"eval.out_dir={tmp_path / 'b'}"])
    again, scored = _model_folder(eval_job)
    assert again == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == written.st_mtime_ns
    assert scored == {
        "model": str(run_dir / "checkpoints" / "4"),
        "run_dir": str(run_dir),
        "step": 4,
        "exported_to": str(folder),
    }
    assert export_once(run_dir / "checkpoints" / "2")[0] == run_dir / "exports" / "2"
    assert sorted(p.name for p in (run_dir / "exports").iterdir()) == ["2", "4"]
