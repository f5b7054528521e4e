"""The core of `benchmarks/async_sim.py` on cases computed by hand (exact virtual seconds:
0.125 s per decode step x 8 tokens = 1.0 s per group, all binary fractions)."""

from __future__ import annotations

import pytest

from tests.unit.benchmarks.loading import load_benchmark

sim = load_benchmark("async_sim")
ONE = dict(engines=1, prompts_per_step=4, group_size=2, slots=4, token_s=0.125, sync_s=0.0,
           steps=5, warmup=1)  # fmt: skip


def test_sync_one_engine_fixed_lengths_is_generation_plus_step():
    # each update: 4 groups side by side for 8 tokens (1.0 s), then a 2.0 s step
    r = sim.simulate(sim.SimConfig(max_lag=0, step_s=2.0, **ONE), "fixed", 8)
    assert r.steps_per_hour == 3600 / (1.0 + 2.0) == 1200.0
    assert r.seconds_per_step == 3.0
    assert r.trainer_idle_fraction == 1 / 3
    assert r.engine_idle_fraction == 1 - 1 / 3
    assert r.lag_counts == {0: 16} and r.dropped_lag == 0


def test_async_lag1_generation_equal_to_step_leaves_no_trainer_idle():
    # the next update's groups are generated while the trainer steps: period max(1.0, 1.0)
    r = sim.simulate(sim.SimConfig(max_lag=1, step_s=1.0, **ONE), "fixed", 8)
    assert r.steps_per_hour == 3600.0
    assert r.trainer_idle_fraction == 0.0
    assert r.engine_idle_fraction == 0.0
    assert r.lag_counts == {1: 16} and r.dropped_lag == 0


def test_sync_push_pauses_everyone():
    # a 0.5 s push adds to the period: 1.0 + 2.0 + 0.5
    r = sim.simulate(sim.SimConfig(max_lag=0, step_s=2.0, **{**ONE, "sync_s": 0.5}), "fixed", 8)
    assert r.seconds_per_step == 3.5
    assert r.trainer_idle_fraction == 1.0 / 3.5


def test_engine_bound_async_gains_only_the_step():
    # two waves of 4 groups per update (8 prompts ahead, 4 slots): generation 2.0 s > step 1.0 s,
    # so async runs at the engine's pace: one update per 2.0 s, the trainer idle half of it
    cfg = sim.SimConfig(max_lag=1, step_s=1.0, **{**ONE, "prompts_per_step": 8, "steps": 6})
    r = sim.simulate(cfg, "fixed", 8)
    assert r.seconds_per_step == 2.0
    assert r.trainer_idle_fraction == 0.5
    assert r.engine_idle_fraction == 0.0


def test_length_samplers():
    import random

    rng = random.Random(0)
    assert sim.length_sampler("fixed", 8, 3)(rng) == [8, 8, 8]
    tail = [sim.length_sampler("tail10x8", 8, 2)(rng) for _ in range(2000)]
    assert {tuple(x) for x in tail} == {(8, 8), (64, 64)}
    assert 150 < sum(x[0] == 64 for x in tail) < 250
    assert all(1 <= n <= 128 for n in sim.length_sampler("lognormal", 8, 4)(rng))
    with pytest.raises(ValueError, match="tail"):
        sim.length_sampler("pareto", 8, 2)
