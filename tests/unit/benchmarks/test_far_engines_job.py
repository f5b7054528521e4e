"""The figures of `benchmarks/far_engines_job.py` on records written by hand: each engine's lag
at every publication, the versions it never loaded, and the median push of each kind per host
(an engine's records named as `deploy.local.hosts_job.MainJobOnHosts` names them)."""

from __future__ import annotations

from tests.unit.benchmarks.loading import load_benchmark

fej = load_benchmark("far_engines_job")


def _loaded(engine: str, v: int) -> dict:
    return {"event": "loaded", "engine": engine, "version": v}


def _published(v: int) -> dict:
    return {"event": "published", "version": v}


def test_lag_at_each_publication_and_skipped_versions():
    events = [
        _loaded("engine0-near-a1", 0), _loaded("engine2-far20-b2", 0),
        _published(1), _loaded("engine0-near-a1", 1),
        _published(2), _loaded("engine0-near-a1", 2),
        _published(3), _loaded("engine0-near-a1", 3), _loaded("engine2-far20-b2", 3),
    ]  # fmt: skip
    out = fej.lags(events)
    assert out["near"] == {"lag": {1: 3}, "versions_skipped": []}
    assert out["far20"] == {"lag": {1: 1, 2: 1, 3: 1}, "versions_skipped": [1, 2]}
    assert "far100" not in out  # an engine that never loaded has no lag to report


def test_pushes_split_by_host_and_kind_refused_ones_left_out():
    def push(engine: str, v: int, base: int | None, wire: int, s: float, loaded: bool = True):
        return {"engine": engine, "version": v, "base": base, "wire_bytes": wire,
                "payload_bytes": 1000, "seconds": s, "loaded": loaded}  # fmt: skip

    summary = {"delta_pushes": [
        push("engine1-far100-x@10.0.0.3:5", 1, None, 700, 2.0),
        push("engine1-far100-x@10.0.0.3:5", 2, 1, 30, 0.5),
        push("engine1-far100-x@10.0.0.3:5", 3, 2, 50, 0.7),
        push("engine1-far100-x@10.0.0.3:5", 4, 3, 10, 9.0, loaded=False),
    ]}  # fmt: skip
    out = fej.pushes(summary)
    assert out["far100"] == {
        "deltas": 2, "keyframes": 1, "delta_bytes": 40, "keyframe_bytes": 700,
        "delta_s": 0.6, "keyframe_s": 2.0, "full_bf16_bytes": 1000,
    }  # fmt: skip
    assert out["near"]["deltas"] == 0 and out["near"]["delta_bytes"] is None


def test_idle_skips_the_first_step():
    rows = [{"step": 1, "idle_fraction": 0.9}, {"step": 2, "idle_fraction": 0.1},
            {"step": 3, "idle_fraction": 0.3}]  # fmt: skip
    assert fej.idle(rows) == 0.2
    assert fej.idle([{**r, "total_time_s": r["step"]} for r in rows], "total_time_s") == 2.5
