"""Issue 11, exact resume, through the real main job (`python -m trainer train`, smoke config:
tiny random model, one JAX engine): SIGINT at a seeded random step finishes the step under way,
saves a checkpoint and exits 130; the rerun with the same run_dir prints the step it resumes
from and trains the rest. Over both runs each step appears once in metrics.jsonl, every problem
position is consumed (trained or filtered) at most once and none below the final frontier is
skipped, the counts add up per run, and lag stays within max_lag."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.smoke_job import (
    REPO,
    assert_no_group_lost,
    child_env,
    jsonl_rows,
    smoke_command,
)

STEPS, MAX_LAG = 8, 1  # configs/smoke.yaml has max_lag 1


def _command(run_dir: Path, *overrides: str) -> list[str]:
    return smoke_command(run_dir, f"trainer.steps={STEPS}", *overrides)


def _consumed(loop: dict) -> int:
    return loop["trained_groups"] + assert_no_group_lost(loop)


@pytest.mark.slow
def test_sigint_at_a_random_step_then_resume_trains_every_problem_once(tmp_path):
    stop_after = random.Random(11).randint(2, STEPS - 3)  # the seeded random step
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    with (tmp_path / "first.err").open("w") as err:
        job = subprocess.Popen(
            _command(run_dir, "launch.progress=false"), cwd=REPO, env=child_env(tmp_path),
            stdout=subprocess.DEVNULL, stderr=err, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while not (metrics.exists() and metrics.read_text().count("\n") >= stop_after):
                assert job.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
                assert time.monotonic() < deadline, f"no step {stop_after} within 240 s"
                time.sleep(0.2)
            job.send_signal(signal.SIGINT)
            assert job.wait(120) == 130, (tmp_path / "first.err").read_text()[-3000:]
        finally:
            if job.poll() is None:
                job.kill()
    first_err = (tmp_path / "first.err").read_text()
    assert "SIGINT: finishing the current step, then saving a checkpoint" in first_err
    first = json.loads((run_dir / "job_summary.json").read_text())
    loop1 = first["loop"]
    stopped_at = loop1["steps"]
    assert first["stop_reason"] == loop1["stop_reason"] == "interrupted (SIGINT)"
    assert first["exit_code"] == 130 and first["eval_after"] is None
    # the step under way when the signal came was finished (or, still collecting, abandoned)
    assert stop_after <= stopped_at < STEPS
    assert (run_dir / "checkpoints" / str(stopped_at)).is_dir()
    assert [r["step"] for r in jsonl_rows(metrics)] == list(range(1, stopped_at + 1))
    consumed1 = _consumed(loop1)
    assert loop1["data_frontier"] + len(loop1["consumed_beyond"]) == consumed1

    second = subprocess.run(
        _command(run_dir, "launch.progress=true"), cwd=REPO, env=child_env(tmp_path),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    checkpoint = run_dir.absolute() / "checkpoints" / str(stopped_at)
    assert f"resuming from step {stopped_at} (checkpoint {checkpoint})" in second.stderr
    assert "eval before" in second.stderr and "group" in second.stderr  # the eval's bar
    summary = json.loads((run_dir / "job_summary.json").read_text())
    loop2 = summary["loop"]
    assert (summary["stop_reason"], summary["resumed_from_step"]) == ("completed", stopped_at)
    assert (loop2["steps"], loop2["version"]) == (STEPS, STEPS)
    consumed2 = _consumed(loop2)

    rows = jsonl_rows(metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["lag_max"] <= MAX_LAG for r in rows)
    groups = jsonl_rows(run_dir / "groups.jsonl")
    positions = [g["position"] for g in groups]
    assert len(positions) == len(set(positions)) == consumed1 + consumed2  # none twice
    final = set(range(loop2["data_frontier"])) | set(loop2["consumed_beyond"])
    assert set(positions) == final  # none skipped below the final frontier
    assert all(g["lag"] <= MAX_LAG for g in groups if g["outcome"] == "trained")
    resumed = [g for g in groups if g["step"] > stopped_at]
    assert resumed and all(g["sample_id"].split(":")[0].endswith("@1") for g in resumed)
    trained = sum(g["outcome"] == "trained" for g in groups)
    assert trained == loop1["trained_groups"] + loop2["trained_groups"] == STEPS * 4
