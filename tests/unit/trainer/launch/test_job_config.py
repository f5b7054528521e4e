"""The job config: sections, overrides, the run_dir alias and errors that name the key."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.config import ConfigError
from trainer.launch.job_config import load_job_config

REPO = Path(__file__).resolve().parents[4]
CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


def test_every_shipped_config_is_checked():
    assert len(CONFIGS) == 6, CONFIGS  # a new config joins the check below by itself


@pytest.mark.parametrize("backend", ["vllm", "jax"])
@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_validate(name, backend):
    job = load_job_config(REPO / "configs" / name, [f"rollout.backend={backend}"])
    assert job.run.trainer.steps >= 1
    assert job.run.model.path
    if name == "smollm2_arith_lora.yaml":  # the LoRA main job pushes adapters only
        assert (job.run.lora.rank, job.run.sync.lora_only) == (16, True)


def test_overrides_reach_every_section(tmp_path):
    job = load_job_config(
        REPO / "configs" / "smoke.yaml",
        [f"run_dir={tmp_path}", "trainer.steps=7", "rollout.backend=vllm", "eval.samples=3",
         "data.size=10", "launch.num_engines=2"],
    )  # fmt: skip
    assert job.run_dir == tmp_path
    assert job.run.trainer.steps == 7
    assert job.run.rollout.backend == "vllm"
    assert (job.eval.samples, job.data.size, job.launch.num_engines) == (3, 10, 2)
    assert load_job_config(None, ["eval.every=2"]).eval.every == 2
    assert job.eval.every == 0  # off unless asked
    assert job.engine_dtype == "bfloat16"  # vllm's default on CPU
    assert load_job_config(REPO / "configs" / "smoke.yaml").engine_dtype == "float32"  # jax


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("eval.sise=2", "eval.sise"),
        ("trainer.stepz=2", "trainer.stepz"),
        ("launch.num_engines=0", "launch.num_engines"),
        ("eval.every=-1", "eval.every: Input should be greater than or equal to 0"),
        ("eval.every=two", "eval.every"),
        ("rollout.backend=sglang", "rollout.backend"),
        ("data.source=csv", "data.source"),
        ("nosection.x=1", "nosection"),
        ("rollout.max_lag", "expected section.key=value"),
    ],
)
def test_bad_override_names_the_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_job_config(REPO / "configs" / "smoke.yaml", [override])


def test_unknown_section_in_yaml(tmp_path):
    file = tmp_path / "bad.yaml"
    file.write_text("trainer: {steps: 2}\nlaunh: {num_engines: 1}\n")
    with pytest.raises(ConfigError, match="launh"):
        load_job_config(file)


def test_greedy_eval_beside_t1_training_with_either_engine():
    # the JAX engine takes the temperature per request (rollout_engine.jax.sampling.RowSampling)
    for backend in ("jax", "vllm"):
        job = load_job_config(
            REPO / "configs" / "smoke.yaml", [f"rollout.backend={backend}", "eval.temperature=0"]
        )
        assert (job.eval_temperature, job.run.rollout.temperature) == (0.0, 1.0)


def test_cli_help_and_bad_key_answer_fast():
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--config", "configs/smoke.yaml", "x.y=1"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "unknown key 'x.y'" in out.stderr
    assert time.monotonic() - t0 < 10  # no JAX, torch or vLLM import before the config checks


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.tp=2", "launch.trainer_devices=3"],
            "trainer.dp x trainer.tp = 1 x 2 does not divide the trainer's 3 devices",
        ),
        (
            ["trainer.tp=2", "trainer.fsdp=2", "launch.trainer_devices=2"],
            "trainer.dp x fsdp x tp = 1 x 2 x 2 = 4, but the trainer has 2 devices",
        ),
        (["trainer.tp=0"], "trainer.tp: Input should be greater than or equal to 1"),
        (
            ["trainer.ep=2", "trainer.tp=2", "launch.trainer_devices=6"],
            r"trainer.dp x trainer.ep x trainer.tp = 1 x 2 x 2 does not divide the trainer's 6",
        ),
        (
            ["trainer.ep=2", "trainer.fsdp=2", "launch.trainer_devices=2"],
            "trainer.dp x fsdp x ep x tp = 1 x 2 x 2 x 1 = 4, but the trainer has 2 devices",
        ),
        (["trainer.ep=0"], "trainer.ep: Input should be greater than or equal to 1"),
        (
            ["launch.jax_tp=2", "launch.devices_per_engine=3"],
            "launch.jax_tp=2 does not divide launch.devices_per_engine=3",
        ),
    ],
)
def test_a_mesh_that_does_not_tile_the_devices_names_the_numbers(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(REPO / "configs" / "smoke.yaml", overrides)
    job = load_job_config(
        REPO / "configs" / "smoke.yaml", ["trainer.tp=2", "launch.trainer_devices=4"]
    )
    assert (job.run.trainer.tp, job.run.trainer.fsdp) == (2, -1)
