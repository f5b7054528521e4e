"""Truncating metrics.jsonl / groups.jsonl to the step a run resumes from."""

from __future__ import annotations

import json

from trainer.run_files import keep_rows_up_to, truncate_step_logs


def _write(path, rows, torn: str = ""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)


def test_rows_after_the_restored_step_are_dropped(tmp_path):
    _write(tmp_path / "metrics.jsonl", [{"step": s, "reward_mean": s / 10} for s in range(1, 8)])
    groups = [{"step": s, "sample_id": f"{i}:p{i}"} for i, s in enumerate([1, 1, 2, 2, 3, 3])]
    _write(tmp_path / "groups.jsonl", groups, torn='{"step": 4, "sample')
    assert truncate_step_logs(tmp_path, 2) == {"metrics.jsonl": 5, "groups.jsonl": 3}
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2]
    kept = [json.loads(x) for x in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert [g["sample_id"] for g in kept] == ["0:p0", "1:p1", "2:p2", "3:p3"]
    assert not list(tmp_path.glob("*.tmp"))
    # nothing to drop: the file is left alone; a missing one is fine
    assert keep_rows_up_to(tmp_path / "metrics.jsonl", 2) == 0
    assert keep_rows_up_to(tmp_path / "absent.jsonl", 0) == 0


def test_step_zero_clears_a_fresh_runs_folder(tmp_path):
    _write(tmp_path / "metrics.jsonl", [{"step": 1}, {"note": "no step"}, {"step": 2}])
    assert keep_rows_up_to(tmp_path / "metrics.jsonl", 0) == 2
    assert (tmp_path / "metrics.jsonl").read_text() == '{"note": "no step"}\n'


def test_every_start_gets_a_new_attempt(tmp_path):
    from trainer.run_files import next_attempt

    assert [next_attempt(tmp_path) for _ in range(3)] == [0, 1, 2]
    assert next_attempt(tmp_path, at_least=7) == 7  # a checkpoint's attempt + 1 wins
    assert next_attempt(tmp_path, at_least=1) == 8  # two starts from one checkpoint differ
    (tmp_path / "attempts.txt").write_text("torn")
    assert next_attempt(tmp_path, at_least=2) == 2
