"""The figures of `benchmarks/trainer_processes.py` from a run folder written by hand: step 1's
push left out, each process's share of every later version, medians, and a process that
logged no send of a pushed version is an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.benchmarks.loading import load_benchmark

bench = load_benchmark("trainer_processes")


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_push_figures_leave_out_the_first_push_and_split_the_bytes(tmp_path):
    _write(tmp_path / "metrics.jsonl", [
        {"version": 1, "sync_time_s": 9.0, "sync_sent_bytes": 600},
        {"version": 2, "sync_time_s": 2.0, "sync_sent_bytes": 600},
        {"version": 3, "sync_time_s": 1.0, "sync_sent_bytes": 500},
        {"version": 4, "sync_time_s": 4.0, "sync_sent_bytes": 500},
    ])  # fmt: skip
    _write(tmp_path / "logs" / "trainer1_sends.jsonl", [
        {"version": v, "ok": True, "num_bytes": 400 if v < 3 else 500} for v in (1, 2, 3, 4)
    ])  # fmt: skip
    got = bench.push_figures(tmp_path, 2)
    assert got["pushes"] == 3 and got["push_s"] == 2.0
    assert got["sent_bytes_by_process"] == {"0": 500, "1": 500}
    assert got["sent_fraction_by_process"] == {"0": 0.5, "1": 0.5}  # medians of .6/.5/.5
    assert got["version_bytes"] == 1000


def test_a_version_another_process_did_not_send_is_an_error(tmp_path):
    _write(tmp_path / "metrics.jsonl", [
        {"version": v, "sync_time_s": 1.0, "sync_sent_bytes": 1} for v in (1, 2, 3)
    ])  # fmt: skip
    _write(tmp_path / "logs" / "trainer1_sends.jsonl", [{"version": 2, "num_bytes": 1}])
    with pytest.raises(KeyError):
        bench.push_figures(tmp_path, 2)
    _write(tmp_path / "metrics.jsonl", [{"version": 1, "sync_time_s": 1.0, "sync_sent_bytes": 1}])
    with pytest.raises(ValueError, match="fewer than 2 steps"):
        bench.push_figures(tmp_path, 1)


def test_data_planes_are_compared_on_one_engine_at_each_process_count(tmp_path, monkeypatch):
    """With gloo and jax_transfer every job runs the JAX engine, and the ratio is gloo's push
    seconds over jax_transfer's at the same count of trainer processes."""
    seconds = {
        ("gloo", 1): 2.0,
        ("gloo", 2): 3.0,
        ("jax_transfer", 1): 1.0,
        ("jax_transfer", 2): 1.5,
    }
    calls = []

    def fake_job(p, devices, steps, run_dir, env, data_plane, backend):
        calls.append((p, devices, data_plane, backend))
        return {"trainer_processes": p, "push_s": seconds[(data_plane, p)],
                "version_bytes": 10**9, "data_plane": data_plane}  # fmt: skip

    monkeypatch.setattr(bench, "run_job", fake_job)
    refs = lambda n: {"memcpy_gb_per_s": 1.0, "raw_gloo_gb_per_s": 0.5}  # noqa: E731
    out = bench.bench_trainer_processes([1, 2], 3, tmp_path, {}, refs, ("gloo", "jax_transfer"))
    assert calls == [(1, 2, "gloo", "jax"), (2, 2, "gloo", "jax"),
                     (1, 2, "jax_transfer", "jax"), (2, 2, "jax_transfer", "jax")]  # fmt: skip
    assert out["jax_transfer_over_gloo_by_processes"] == {"1": 2.0, "2": 2.0}
    assert out["push_s_one_over_many"] == round(2.0 / 3.0, 4)
    assert [r["push_over_raw_gloo"] for r in out["runs"]] == [1.0, 0.6667, 2.0, 1.3333]
