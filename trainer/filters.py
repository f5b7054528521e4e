"""Which rollout groups a step trains on: the staleness and zero-variance filters.

A group's lag is ``current_version - version_start`` of its oldest completion (the seed write-up
"Async RL in Pure JAX", section "Samples"); groups with lag > max_lag are dropped, so
``max_lag = 0`` trains only on-policy groups. DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2)
drops groups whose rewards are all equal: their advantages, hence their gradients, are zero.
A group with an aborted completion (an engine gave up on it) is dropped first.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from trainer.rollouts import RolloutGroup

#: What the filters did with one group: trained on it, or dropped it for one reason.
Outcome = Literal["trained", "aborted", "lag", "zero_variance"]


@dataclasses.dataclass
class FilterResult:
    """The groups one update took, sorted by the filters as they arrive (`add`).

    Attributes:
      kept: the groups that pass every filter (arrival order).
      kept_lags: one lag (versions, int >= 0) per kept group.
      dropped_lag: groups dropped because their lag exceeded max_lag.
      dropped_zero_variance: groups dropped because all their rewards were equal.
      dropped_aborted: groups dropped because a completion was aborted (finish_reason "abort").
    """

    kept: list[RolloutGroup] = dataclasses.field(default_factory=list)
    kept_lags: list[int] = dataclasses.field(default_factory=list)
    dropped_lag: int = 0
    dropped_zero_variance: int = 0
    dropped_aborted: int = 0

    def add(
        self, group: RolloutGroup, current_version: int, max_lag: int, drop_zero_variance: bool
    ) -> tuple[Outcome, int]:
        """Sort one group: dropped if aborted, else if its lag > max_lag, else (when
        `drop_zero_variance`) if its rewards are all equal; kept otherwise. A group is counted
        under its first reason only; rewards are read only for a group that passed the others.

        Returns:
          (outcome, lag in versions).

        Raises:
          ValueError: for max_lag < 0, a negative lag, or an unscored group when
            drop_zero_variance is set.
        """
        if max_lag < 0:
            raise ValueError(f"max_lag must be >= 0; got {max_lag}")
        lag = group_lag(group, current_version)
        outcome: Outcome = "trained"
        if any(c.finish_reason == "abort" for c in group.completions):
            self.dropped_aborted += 1
            outcome = "aborted"
        elif lag > max_lag:
            self.dropped_lag += 1
            outcome = "lag"
        elif drop_zero_variance and max(group.rewards) == min(group.rewards):
            self.dropped_zero_variance += 1
            outcome = "zero_variance"
        else:
            self.kept.append(group)
            self.kept_lags.append(lag)
        return outcome, lag

    def metrics(self) -> dict[str, float]:
        """For metrics.jsonl: ``lag_min``, ``lag_mean``, ``lag_max`` of the kept groups (0 when
        none kept) and the drop counts ``filtered_lag``, ``filtered_zero_variance``,
        ``filtered_aborted``."""
        lags = self.kept_lags or [0]
        return {
            "lag_min": min(lags),
            "lag_mean": sum(lags) / len(lags),
            "lag_max": max(lags),
            "filtered_lag": self.dropped_lag,
            "filtered_zero_variance": self.dropped_zero_variance,
            "filtered_aborted": self.dropped_aborted,
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
