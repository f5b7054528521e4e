"""The run's plot: a 0/1 reward's band stays within [0, 1] (±1 standard error, clipped to the
step's rewards), a trailing moving average, held-out accuracy marked without eval.every; and
the closing summary's first/last steps never overlap."""

from __future__ import annotations

import json

import numpy as np

from trainer.launch.plot import plot_metrics, plot_series
from trainer.launch.report import format_summary, reward_ends


def _row(step: int, mean: float, std: float, **more: float) -> dict:
    return {"step": step, "reward_mean": mean, "reward_std": std, "lag_mean": 1.0,
            "lag_max": 1, **more}  # fmt: skip


def test_band_of_a_0_1_reward_stays_within_0_1():
    # 0/1 rewards: 32 completions at mean 0.5 (std 0.5), 4 at mean 0.75, 2 all correct
    rows = [
        _row(1, 0.5, 0.5, reward_min=0.0, reward_max=1.0, reward_count=32),
        _row(2, 0.75, 0.75**0.5 * 0.25**0.5, reward_min=0.0, reward_max=1.0, reward_count=4),
        _row(3, 1.0, 0.0, reward_min=1.0, reward_max=1.0, reward_count=2),
        _row(4, 0.05, 0.2179, reward_min=0.0, reward_max=1.0, reward_count=1),
    ]
    s = plot_series(rows)
    np.testing.assert_allclose(s.band_low, [0.5 - 0.5 / 32**0.5, 0.75 - 0.75**0.5 * 0.25, 1.0, 0.0])
    np.testing.assert_allclose(
        s.band_high, [0.5 + 0.5 / 32**0.5, 0.75 + 0.75**0.5 * 0.25, 1.0, 0.2679]
    )
    assert s.band_low.min() >= 0.0 and s.band_high.max() <= 1.0
    # rows written before reward_min/max/count: mean ± std, clipped to the run's means
    old = plot_series([_row(1, 0.2, 0.4), _row(2, 0.5, 0.5), _row(3, 0.8, 0.4)])
    np.testing.assert_allclose(old.band_low, [0.2, 0.2, 0.4])
    np.testing.assert_allclose(old.band_high, [0.6, 0.8, 0.8])


def test_moving_average_and_held_out_points(tmp_path):
    rewards = [0.0, 1.0, 0.5, 0.5, 1.0, 0.0, 1.0]
    rows = [_row(i + 1, r, 0.0) for i, r in enumerate(rewards)]
    s = plot_series(rows, [(7, 0.27), (0, 0.08)])
    assert s.window == 5
    np.testing.assert_allclose(s.moving, [0.0, 0.5, 0.5, 0.5, 0.6, 0.6, 0.6])
    assert s.held_out == [(0, 0.08), (7, 0.27)]
    assert plot_series(rows[:3]).window == 3
    with (tmp_path / "metrics.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert plot_metrics(tmp_path, [(0, 0.08), (7, 0.27)]).read_bytes()[:4] == b"\x89PNG"


def test_first_and_last_steps_of_a_short_run_do_not_overlap():
    assert reward_ends([0.1, 0.2, 0.3, 0.5]) == {
        "reward_first5": 0.15000000000000002, "reward_last5": 0.4, "reward_ends_steps": 2,
    }  # fmt: skip
    assert reward_ends([0.25]) == {
        "reward_first5": 0.25,
        "reward_last5": 0.25,
        "reward_ends_steps": 0,
    }
    assert reward_ends(list(range(12)))["reward_ends_steps"] == 5
    loop = {"steps": 4, "version": 4, "submitted": 20, "trained_groups": 16, "filtered_lag": 0,
            "filtered_zero_variance": 0, "filtered_aborted": 0, "in_flight": 4}  # fmt: skip
    text = format_summary({"loop": loop, "backend": "jax", **reward_ends([0.1, 0.2, 0.3, 0.5])})
    assert text.splitlines()[1] == "mean reward: first 2 steps 0.150, last 2 steps 0.400"
