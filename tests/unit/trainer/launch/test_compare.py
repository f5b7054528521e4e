"""`python -m trainer compare`: each run's curve values, held-out points from the summary or
eval rows, and clear errors for a folder without training rows or a label count that differs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.launch.compare import compare_runs

REPO = Path(__file__).resolve().parents[4]


def _run(path: Path, rewards: list[float], summary: dict | None = None, evals=()) -> Path:
    path.mkdir()
    rows = [{"step": i + 1, "reward_mean": r, "lag_mean": 0.0, "lag_max": 0}
            for i, r in enumerate(rewards)]  # fmt: skip
    rows += [{"step": s, "eval/tag": f"every/{s}", "eval/accuracy": a} for s, a in evals]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (path / "job_summary.json").write_text(json.dumps(summary))
    return path


def test_curves_and_held_out_of_each_run(tmp_path):
    full = _run(tmp_path / "full", [0.0, 1.0, 0.5, 0.5, 1.0, 0.0, 1.0],
                {"loop": {"steps": 7}, "eval_before": {"accuracy": 0.08},
                 "eval_after": {"accuracy": 0.27}})  # fmt: skip
    lora = _run(tmp_path / "lora", [0.25, 0.75], evals=[(1, 0.5), (2, 0.625)])
    full_run, lora_run = compare_runs([full, lora], ["full", "LoRA"])
    assert full_run["label"] == "full" and full_run["steps"] == [1, 2, 3, 4, 5, 6, 7]
    np.testing.assert_allclose(full_run["moving"], [0.0, 0.5, 0.5, 0.5, 0.6, 0.6, 0.6])
    assert full_run["held_out"] == [(0, 0.08), (7, 0.27)]
    assert (full_run["reward_first5"], full_run["reward_ends_steps"]) == (0.5, 3)
    assert lora_run["window"] == 2 and lora_run["moving"] == [0.25, 0.5]
    assert lora_run["held_out"] == [(1, 0.5), (2, 0.625)]


def test_errors_name_the_folder_or_the_counts(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty/metrics.jsonl has no training rows"):
        compare_runs([empty])
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        compare_runs([empty, empty], ["one"])
    with pytest.raises(ValueError, match="at least one run"):
        compare_runs([])


def test_the_command_writes_the_plot_and_one_json_line(tmp_path):
    a = _run(tmp_path / "a", [0.1, 0.3])
    b = _run(tmp_path / "b", [0.2, 0.2, 0.4])
    out = tmp_path / "plots" / "ab.png"
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "compare", str(a), str(b), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["label"], r["reward_last5"]) for r in last] == [
        ("a", 0.3),
        ("b", 0.4),
    ]  # k = 1 of 2 and 3 steps
    bad = subprocess.run(
        [sys.executable, "-m", "trainer", "compare", str(tmp_path / "none"), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "no training rows" in bad.stderr
