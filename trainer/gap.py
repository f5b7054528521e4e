"""The engine-trainer gap of one step: statistics of the importance ratio pi_theta / pi_sampler.

Legend: B rows, L padded length. Inputs are the log-probs the train step already computed (no
extra forward), the engine's log-probs, the loss mask and each row's lag (trainer version at
the step minus the group's oldest ``version_start``, as `trainer.filters.group_lag`).

For the masked tokens of each of three sets, ``all``, ``lag0`` (rows of lag 0: the engine and
the trainer hold the same weights, so the gap is the numerical mismatch alone) and ``lag1plus``
(lag >= 1: mismatch plus the policy's drift since sampling):

- ``sampler_kl``: the k3 estimate of KL(pi_sampler || pi_theta), mean of r - 1 - log r
  (J. Schulman, "Approximating KL Divergence", 2020);
- ``ratio_mean``, ``ratio_min``, ``ratio_max``, ``ratio_p01``, ``ratio_p99`` (1st / 99th
  percentiles, linear interpolation as `numpy.percentile`);
- ``frac_log_ratio_gt_0.2``: share of tokens with |log r| > 0.2 (the cut of Yao et al. 2025,
  "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", whose figures show
  the share of tokens far from ratio 1);
- ``tokens``: masked token count (the statistics of a set with no token are NaN; the train step
  leaves them out of its host metrics).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

GAP_SETS: tuple[str, ...] = ("all", "lag0", "lag1plus")
GAP_STATS: tuple[str, ...] = (
    "sampler_kl",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "ratio_p01",
    "ratio_p99",
    "frac_log_ratio_gt_0.2",
    "tokens",
)
LOG_RATIO_CUT = 0.2


def _stats(log_ratio: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Statistics of exp(log_ratio) [N] over `mask` [N] bool (see the module docstring)."""
    n = jnp.sum(mask.astype(jnp.float32))
    safe = jnp.where(mask, log_ratio, 0.0)
    ratio = jnp.exp(safe)
    denom = jnp.maximum(n, 1.0)
    nan = jnp.float32(jnp.nan)
    some = n > 0
    with_nan = jnp.where(mask, ratio, nan)
    p01, p99 = jnp.nanpercentile(with_nan, jnp.array([1.0, 99.0]))
    return {
        "sampler_kl": jnp.where(
            some, jnp.sum(jnp.where(mask, ratio - 1.0 - safe, 0.0)) / denom, nan
        ),
        "ratio_mean": jnp.where(some, jnp.sum(jnp.where(mask, ratio, 0.0)) / denom, nan),
        "ratio_min": jnp.where(some, jnp.min(jnp.where(mask, ratio, jnp.inf)), nan),
        "ratio_max": jnp.where(some, jnp.max(jnp.where(mask, ratio, -jnp.inf)), nan),
        "ratio_p01": jnp.where(some, p01, nan),
        "ratio_p99": jnp.where(some, p99, nan),
        "frac_log_ratio_gt_0.2": jnp.where(
            some, jnp.sum(mask & (jnp.abs(safe) > LOG_RATIO_CUT)) / denom, nan
        ),
        "tokens": n,
    }


def gap_metrics(
    logprobs: jax.Array, sampler_logprobs: jax.Array, mask: jax.Array, lag: jax.Array
) -> dict[str, jax.Array]:
    """The gap statistics, keyed ``"gap/{set}/{stat}"`` (sets `GAP_SETS`, stats `GAP_STATS`).

    Args:
      logprobs: [B, L] float32 trainer log-probs of the targets (taken under stop-gradient).
      sampler_logprobs: [B, L] float32 the engine's log-probs of the same tokens.
      mask: [B, L] the loss mask (tokens that count are > 0).
      lag: [B] int, each row's lag in weight versions (>= 0).

    Returns:
      [] float32 arrays; NaN for a set with no token (``tokens`` is then 0). Jittable.
    """
    logprobs = jax.lax.stop_gradient(logprobs.astype(jnp.float32))
    log_ratio = (logprobs - sampler_logprobs.astype(jnp.float32)).reshape(-1)
    on = (mask > 0).reshape(-1)
    row_lag = jnp.broadcast_to(lag[:, None], mask.shape).reshape(-1)
    sets = {"all": on, "lag0": on & (row_lag == 0), "lag1plus": on & (row_lag >= 1)}
    out: dict[str, jax.Array] = {}
    for name, selected in sets.items():
        for stat, value in _stats(log_ratio, selected).items():
            out[f"gap/{name}/{stat}"] = value
    return out


def summarize_gap(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The gap over a run's steps, from each step's host metrics (``gap/...`` keys; others
    ignored): ``ratio_min`` the smallest and ``ratio_max`` the largest of the steps, ``tokens``
    the sum, every other statistic the token-weighted mean over the steps that have the set.
    Returns {} for no steps.
    """
    out: dict[str, float] = {}
    for name in GAP_SETS:
        have = [r for r in rows if f"gap/{name}/tokens" in r]
        weights = [r[f"gap/{name}/tokens"] for r in have]
        if not have or sum(weights) == 0:
            continue
        for stat in GAP_STATS:
            values = [r[f"gap/{name}/{stat}"] for r in have]
            key = f"gap/{name}/{stat}"
            if stat == "ratio_min":
                out[key] = min(values)
            elif stat == "ratio_max":
                out[key] = max(values)
            elif stat == "tokens":
                out[key] = sum(values)
            else:
                out[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)
    return out
