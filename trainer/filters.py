"""Which rollout groups a step trains on: the staleness and zero-variance filters.

A group's lag is ``current_version - version_start`` of its oldest completion (the seed write-up
"Async RL in Pure JAX", section "Samples"); groups with lag > max_lag are dropped, so
``max_lag = 0`` trains only on-policy groups. DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2)
drops groups whose rewards are all equal: their advantages, hence their gradients, are zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from trainer.rollouts import RolloutGroup


@dataclasses.dataclass(frozen=True)
class FilterResult:
    """Kept groups (input order), drop counts and the lags of the kept groups.

    Attributes:
      kept: the groups that pass both filters.
      dropped_lag: groups dropped because their lag exceeded max_lag.
      dropped_zero_variance: groups dropped because all their rewards were equal.
      kept_lags: one lag (versions, int >= 0) per kept group.
    """

    kept: list[RolloutGroup]
    dropped_lag: int
    dropped_zero_variance: int
    kept_lags: list[int]

    def metrics(self) -> dict[str, float]:
        """Counts and lag statistics for the logger: ``kept_groups``, ``dropped_lag``,
        ``dropped_zero_variance``, ``lag_min``, ``lag_mean``, ``lag_max`` (lags 0 when none kept).
        """
        lags = self.kept_lags or [0]
        return {
            "kept_groups": float(len(self.kept)),
            "dropped_lag": float(self.dropped_lag),
            "dropped_zero_variance": float(self.dropped_zero_variance),
            "lag_min": float(min(lags)),
            "lag_mean": sum(lags) / len(lags),
            "lag_max": float(max(lags)),
        }


def group_lag(group: RolloutGroup, current_version: int) -> int:
    """Versions between `current_version` and the group's oldest `version_start`.

    Raises:
      ValueError: if a completion started at a version newer than `current_version`.
    """
    lag = current_version - group.version_start
    if lag < 0:
        raise ValueError(
            f"group {group.sample_id!r} started at version {group.version_start}, newer than the "
            f"trainer's current version {current_version}"
        )
    return lag


def filter_groups(
    groups: Iterable[RolloutGroup],
    current_version: int,
    max_lag: int,
    drop_zero_variance: bool,
) -> FilterResult:
    """Drop stale groups (lag > max_lag), then, if asked, zero-reward-variance groups.

    A group dropped for lag is not also counted as zero-variance. Rewards are only read for
    groups that pass the lag filter and only when `drop_zero_variance` is set.

    Raises:
      ValueError: for max_lag < 0, a negative lag, or an unscored group when
        drop_zero_variance is set.
    """
    if max_lag < 0:
        raise ValueError(f"max_lag must be >= 0; got {max_lag}")
    kept: list[RolloutGroup] = []
    lags: list[int] = []
    dropped_lag = dropped_zero_variance = 0
    for group in groups:
        lag = group_lag(group, current_version)
        if lag > max_lag:
            dropped_lag += 1
            continue
        if drop_zero_variance:
            rewards = group.rewards
            if max(rewards) == min(rewards):
                dropped_zero_variance += 1
                continue
        kept.append(group)
        lags.append(lag)
    return FilterResult(kept, dropped_lag, dropped_zero_variance, lags)
