"""The lag and zero-variance filters, with exact counts."""

import pytest

from gateway.messages import Completion
from trainer.filters import FilterResult, group_lag
from trainer.rollouts import RolloutGroup


def _group(sample_id, starts, rewards):
    comps = [
        Completion([1], [-0.5], "stop", s, s + 1, reward=r)
        for s, r in zip(starts, rewards, strict=True)
    ]
    return RolloutGroup(sample_id, [0], comps)


def filter_groups(groups, current_version, max_lag, drop_zero_variance):
    out = FilterResult()
    for g in groups:
        out.add(g, current_version, max_lag, drop_zero_variance)
    return out


GROUPS = [
    _group("fresh", [5, 5], [1.0, 0.0]),  # lag 0
    _group("old", [2, 4], [1.0, 0.0]),  # lag 3 (its oldest completion)
    _group("flat", [4, 5], [1.0, 1.0]),  # lag 1, zero variance
    _group("lag2", [3, 3], [0.0, 0.5]),  # lag 2
]


def test_lag_filter_only():
    out = filter_groups(GROUPS, current_version=5, max_lag=2, drop_zero_variance=False)
    assert [g.sample_id for g in out.kept] == ["fresh", "flat", "lag2"]
    assert (out.dropped_lag, out.dropped_zero_variance, out.kept_lags) == (1, 0, [0, 1, 2])


def test_lag_and_zero_variance():
    out = filter_groups(GROUPS, current_version=5, max_lag=3, drop_zero_variance=True)
    assert [g.sample_id for g in out.kept] == ["fresh", "old", "lag2"]
    assert (out.dropped_lag, out.dropped_zero_variance, out.kept_lags) == (0, 1, [0, 3, 2])
    assert out.metrics() == {
        "lag_min": 0,
        "lag_mean": 5 / 3,
        "lag_max": 3,
        "filtered_lag": 0,
        "filtered_zero_variance": 1,
        "filtered_aborted": 0,
    }


def test_on_policy_max_lag_zero():
    out = filter_groups(GROUPS, current_version=5, max_lag=0, drop_zero_variance=True)
    assert [g.sample_id for g in out.kept] == ["fresh"]
    assert (out.dropped_lag, out.dropped_zero_variance) == (3, 0)


def test_aborted_group_is_dropped_first():
    comps = [
        Completion([1], [-0.5], r, s, s + 1, reward=1.0) for r, s in (("abort", 2), ("stop", 5))
    ]
    aborted = RolloutGroup("ab", [0], comps)
    out = FilterResult()
    assert out.add(aborted, 5, 0, True) == ("aborted", 3)  # not counted as lag nor flat
    assert out.add(GROUPS[0], 5, 0, True) == ("trained", 0)
    assert (out.dropped_aborted, out.dropped_lag, out.dropped_zero_variance) == (1, 0, 0)
    assert [g.sample_id for g in out.kept] == ["fresh"] and out.metrics()["lag_max"] == 0


def test_errors():
    with pytest.raises(ValueError, match="newer than the trainer's current version 4"):
        group_lag(GROUPS[0], 4)
    with pytest.raises(ValueError, match="max_lag must be >= 0"):
        filter_groups(GROUPS, 5, -1, False)
    unscored = _group("u", [5], [None])
    with pytest.raises(ValueError, match="have no reward"):
        filter_groups([unscored], 5, 0, True)
    assert len(filter_groups([unscored], 5, 0, False).kept) == 1
