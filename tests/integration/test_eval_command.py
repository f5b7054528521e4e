"""Issue 15: `python -m trainer eval` on the tiny smoke model with each engine, started by the main
job's launcher: exact counts (problems, samples per problem, rows), the summary's metrics equal
those recomputed from the saved rows, and no process is left behind. A `Question`/`Answer` JSONL
goes through flags (the faults before any start: tests/unit/trainer/eval/test_eval_cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.smoke_job import REPO, child_env
from trainer.eval.rows import summary_from_rows

PROBLEMS, SAMPLES, NEW_TOKENS = 5, 3, 16


def _qa_file(tmp_path: Path, rows: int = PROBLEMS + 2) -> Path:
    path = tmp_path / "qa.jsonl"
    lines = [json.dumps({"Question": f"What is {i} + {i}?", "Answer": 2 * i}) for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _eval(tmp_path: Path, *args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "eval", "--model", "tiny:smollm2", *args,
         "launch.progress=false", "launch.jax_num_slots=8", "launch.stop_timeout_s=60"],
        cwd=REPO, env=child_env(tmp_path, PYTHONPATH=str(REPO)),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "temperature"), [("jax", 1.0), pytest.param("vllm", 0.0, marks=pytest.mark.vllm)]
)
def test_eval_with_each_engine(tmp_path, engine, temperature):
    out = tmp_path / "out"
    done = _eval(
        tmp_path, "--data", str(_qa_file(tmp_path)), "--prompt-template", "{Question}",
        "--answer-field", "Answer", "--engine", engine, "--samples", str(SAMPLES),
        "--temperature", str(temperature), "--max-new-tokens", str(NEW_TOKENS),
        "--limit", str(PROBLEMS), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{PROBLEMS} problems x {SAMPLES} samples ({engine}" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == PROBLEMS
    assert [r["problem_id"] for r in rows] == [f"jsonl/qa/{i}" for i in range(PROBLEMS)]
    assert [r["gold"] for r in rows] == [str(2 * i) for i in range(PROBLEMS)]
    for row in rows:
        assert f"What is {row['problem_id'][-1]} + " in row["prompt"]
        for key in ("completions", "answers", "scores", "lengths", "finish_reasons"):
            assert len(row[key]) == SAMPLES, key
        assert all(1 <= n <= NEW_TOKENS for n in row["lengths"])
        assert all(f in ("stop", "length") for f in row["finish_reasons"])
        assert all(s in (0.0, 1.0) for s in row["scores"])
    assert (summary["problems"], summary["samples"], summary["backend"]) == (
        PROBLEMS, SAMPLES, engine,
    )  # fmt: skip
    recomputed = summary_from_rows(rows)
    for key, value in recomputed.items():
        assert summary[key] == pytest.approx(value, abs=1e-12), key
    assert {"pass@1", "pass@2", "pass@3", "maj@1", "maj@2", "maj@3"} <= set(summary)
    cut = sum(f == "length" for r in rows for f in r["finish_reasons"])
    assert summary["length_cut_fraction"] == pytest.approx(cut / (PROBLEMS * SAMPLES))
    assert summary["exit_codes"] == {"gateway": 0, "engine0": 0}
    if temperature == 0.0:  # greedy: every sample of a problem is the same completion
        assert all(len(set(r["completions"])) == 1 for r in rows)
