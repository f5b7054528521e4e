"""Issue 15's W&B: the smoke job (`python -m trainer train --config configs/smoke.yaml`, JAX
engine) with ``logging.wandb.mode=offline`` and no network writes an offline W&B run whose
``run-ID.wandb`` log holds every metrics.jsonl row at its step with the same values, the held-out
accuracy, the job config, and a sample table (prompt, completion, reward, weight version) at
steps 1 and every ``samples_every``; a W&B that cannot start (online without an API key) fails
the job at startup, before any process is started.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.smoke_job import child_env
from tests.wandb_records import history, run_config, run_folder

REPO = Path(__file__).resolve().parents[2]
STEPS, PROMPTS = 4, 4  # configs/smoke.yaml

pytest.importorskip("wandb")


def _env(tmp_path: Path) -> dict[str, str]:
    """The job's environment: W&B's folders inside tmp_path, no API key, offline by config."""
    drop = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_ENTITY", "WANDB_PROJECT")
    wb = {f"WANDB_{k}_DIR": str(tmp_path / f"wb_{k.lower()}") for k in ("CONFIG", "CACHE", "DATA")}
    return child_env(
        tmp_path, drop, **wb, WANDB_DIR=str(tmp_path / "wb"), NETRC=str(tmp_path / "netrc")
    )


def _train(tmp_path: Path, *overrides: str, timeout: int) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "trainer", "train", "--config", "configs/smoke.yaml",
        f"run_dir={tmp_path / 'run'}", "launch.progress=false", "rollout.backend=jax", *overrides,
    ]  # fmt: skip
    return subprocess.run(command, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.mark.slow
def test_offline_wandb_run_holds_the_job_metrics_and_sample_tables(tmp_path):
    done = _train(tmp_path, "logging.wandb.mode=offline", "logging.wandb.samples_every=2",
                  timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "run"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))

    run = run_folder(tmp_path / "wb")
    rows = history(run)
    for row in metrics:  # every numeric entry at its step, the very same float
        logged = rows[row["step"]]
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isnan(value):
                assert math.isnan(logged[key]), key
            else:
                assert logged[key] == float(value), (row["step"], key)
    summary = json.loads((run_dir / "job_summary.json").read_text())
    assert rows[0]["eval/accuracy"] == summary["eval_before"]["accuracy"]
    assert rows[STEPS]["eval/accuracy"] == summary["eval_after"]["accuracy"]

    tables = {s: r for s, r in rows.items() if "samples/nrows" in r}
    assert sorted(tables) == [1, 2, 4]
    assert all(r["samples/nrows"] == PROMPTS for r in tables.values())  # 4 groups < 8 per table
    groups = [json.loads(line) for line in (run_dir / "groups.jsonl").read_text().splitlines()]
    for step, entry in tables.items():
        table = json.loads((run / "files" / entry["samples/path"]).read_text())
        assert table["columns"] == ["step", "prompt", "completion", "reward", "weight_version"]
        assert len(table["data"]) == PROMPTS
        trained = [g for g in groups if g["step"] == step and g["outcome"] == "trained"]
        # row i is the first completion of the i-th trained group: its reward and version
        assert [r[3] for r in table["data"]] == [g["rewards"][0] for g in trained][:PROMPTS]
        assert all(r[0] == step and step - 2 <= r[4] <= step - 1 for r in table["data"])
        assert all("<|im_start|>" not in r[1] and r[1] for r in table["data"])
    config = run_config(run)
    assert config["logging"]["wandb"]["mode"] == "offline"
    assert config["trainer"]["steps"] == STEPS


@pytest.mark.slow
def test_wandb_that_cannot_start_fails_the_job_before_any_process(tmp_path):
    done = _train(tmp_path, "logging.wandb.mode=online", "logging.wandb.init_timeout_s=20",
                  timeout=180)  # fmt: skip
    assert done.returncode != 0
    assert "logging.wandb: wandb.init failed (mode=online" in done.stderr
    assert "No API key configured" in done.stderr
    run_dir = tmp_path / "run"
    # no gateway or engine was started: the trainer's own logs only (library log lines and the
    # error's traceback)
    logs = sorted(p.name for p in (run_dir / "logs").iterdir())
    assert set(logs) <= {"trainer.log", "trainer_error.log"}, logs
    assert not (run_dir / "metrics.jsonl").exists()
    summary = json.loads((run_dir / "job_summary.json").read_text())
    assert "logging.wandb" in summary["stop_reason"]
