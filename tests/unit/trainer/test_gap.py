"""The gap statistics of `trainer.gap` against numpy on a hand-built batch."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.gap import gap_metrics, summarize_gap

# 3 rows x 4 positions; row 2 has lag 1, rows 0 and 1 lag 0; a 0 in the mask is padding
RATIOS = np.array([[1.0, 1.5, 0.5, 9.0], [1.1, 0.7, 1.0, 1.0], [2.0, 0.25, 1.2, 1.0]], np.float64)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
LAG = np.array([0, 0, 1], np.int32)


def _inputs():
    sampler = np.full(RATIOS.shape, -2.0, np.float32)
    sampler[0, 3] = 50.0  # padding may hold anything: it must not leak
    logp = (np.log(RATIOS) + sampler).astype(np.float32)
    return jnp.asarray(logp), jnp.asarray(sampler), jnp.asarray(MASK), jnp.asarray(LAG)


def _expected(values: list[float]) -> dict[str, float]:
    r = np.array(values)
    return {
        "sampler_kl": float(np.mean(r - 1 - np.log(r))),
        "ratio_mean": float(r.mean()),
        "ratio_min": float(r.min()),
        "ratio_max": float(r.max()),
        "ratio_p01": float(np.percentile(r, 1)),
        "ratio_p99": float(np.percentile(r, 99)),
        "frac_log_ratio_gt_0.2": float(np.mean(np.abs(np.log(r)) > 0.2)),
        "tokens": float(len(r)),
    }


def test_gap_metrics_by_lag():
    out = jax.device_get(jax.jit(gap_metrics)(*_inputs()))
    lag0 = [1.0, 1.5, 0.5, 1.1, 0.7]
    lag1 = [2.0, 0.25, 1.2, 1.0]
    for name, values in (("all", lag0 + lag1), ("lag0", lag0), ("lag1plus", lag1)):
        for stat, want in _expected(values).items():
            assert float(out[f"gap/{name}/{stat}"]) == pytest.approx(want, rel=1e-5, abs=1e-6), (
                name,
                stat,
            )
    # by hand: |log r| > 0.2 for 1.5, 0.5, 0.7 of lag 0 (not 1.1: log 1.1 = 0.095)
    assert float(out["gap/lag0/frac_log_ratio_gt_0.2"]) == pytest.approx(3 / 5)
    assert float(out["gap/lag1plus/ratio_min"]) == pytest.approx(0.25)
    k3 = sum(r - 1 - math.log(r) for r in lag1) / 4
    assert float(out["gap/lag1plus/sampler_kl"]) == pytest.approx(k3, rel=1e-5)


def test_a_set_without_tokens_is_nan_with_zero_count():
    logp, sampler, mask, _ = _inputs()
    out = jax.device_get(gap_metrics(logp, sampler, mask, jnp.zeros(3, jnp.int32)))
    assert float(out["gap/lag1plus/tokens"]) == 0
    assert math.isnan(float(out["gap/lag1plus/ratio_mean"]))
    assert float(out["gap/lag0/tokens"]) == 9


def test_summarize_gap_weights_by_tokens():
    rows = [
        {"gap/all/tokens": 2.0, "gap/all/ratio_mean": 1.0, "gap/all/ratio_min": 0.9,
         "gap/all/ratio_max": 1.1},
        {"gap/all/tokens": 6.0, "gap/all/ratio_mean": 2.0, "gap/all/ratio_min": 0.5,
         "gap/all/ratio_max": 1.05, "loss": 3.0},
    ]  # fmt: skip
    for row in rows:
        for stat in ("sampler_kl", "ratio_p01", "ratio_p99", "frac_log_ratio_gt_0.2"):
            row[f"gap/all/{stat}"] = 0.0
    out = summarize_gap(rows)
    assert out["gap/all/ratio_mean"] == pytest.approx((2 * 1.0 + 6 * 2.0) / 8)
    assert out["gap/all/ratio_min"] == 0.5 and out["gap/all/ratio_max"] == 1.1
    assert out["gap/all/tokens"] == 8.0
    assert "gap/lag0/ratio_mean" not in out
    assert summarize_gap([]) == {}
