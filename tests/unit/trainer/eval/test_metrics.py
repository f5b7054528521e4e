"""pass@k, maj@k and the summary against values computed by hand for crafted score tables."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from trainer.eval.metrics import ProblemSamples, k_values, maj_at_k, pass_at_k, summarize


@pytest.mark.parametrize(
    ("c", "k", "expected"),
    [
        (0, 1, 0.0), (0, 2, 0.0), (0, 4, 0.0),
        (1, 1, 0.25), (1, 2, 0.5), (1, 4, 1.0),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (2, 1, 0.5), (2, 2, 5 / 6), (2, 4, 1.0),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (3, 1, 0.75), (3, 2, 1.0), (4, 1, 1.0),
    ],
)  # fmt: skip
def test_pass_at_k_n4_by_hand(c: int, k: int, expected: float) -> None:
    assert pass_at_k(4, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_for_large_n() -> None:
    # C(1000, 500) overflows a float; the product form stays exact to 1e-12
    exact = 1 - Fraction(math.comb(1000 - 7, 500), math.comb(1000, 500))
    assert pass_at_k(1000, 7, 500) == pytest.approx(float(exact), abs=1e-12)


def test_pass_at_k_refuses_bad_counts() -> None:
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c=5"):
        pass_at_k(4, 5, 1)


def test_maj_at_k_ties_go_to_the_first_seen_answer() -> None:
    answers, scores = ["7", "3", "3", "7"], [1.0, 0.0, 0.0, 1.0]
    assert [maj_at_k(answers, scores, k) for k in (1, 2, 4)] == [1.0, 1.0, 1.0]
    answers, scores = ["3", "7", "7", "3"], [0.0, 1.0, 1.0, 0.0]
    assert [maj_at_k(answers, scores, k) for k in (1, 2, 4)] == [0.0, 0.0, 0.0]


def test_maj_at_k_skips_missing_answers() -> None:
    answers, scores = [None, "2", "8", "8"], [0.0, 0.0, 1.0, 1.0]
    assert [maj_at_k(answers, scores, k) for k in (1, 2, 4)] == [0.0, 0.0, 1.0]
    assert maj_at_k([None, None], [0.0, 0.0], 2) == 0.0


def test_summary_of_a_crafted_table() -> None:
    table = [
        ProblemSamples([1, 0, 0, 1], ["7", "3", "3", "7"], [10, 20, 30, 40], [0, 0, 0, 1]),
        ProblemSamples([0, 0, 0, 1], ["5", "5", None, "9"], [16, 16, 16, 16], [1, 1, 1, 1]),
        ProblemSamples([0, 0, 1, 1], [None, "2", "8", "8"], [1, 2, 3, 4], [0, 0, 0, 0]),
    ]
    got = summarize(table)
    assert got["problems"] == 3 and got["samples"] == 4
    assert got["pass@1"] == pytest.approx((0.5 + 0.25 + 0.5) / 3)
    assert got["pass@2"] == pytest.approx((5 / 6 + 0.5 + 5 / 6) / 3)
    assert got["pass@4"] == pytest.approx(1.0)
    assert got["maj@1"] == pytest.approx(1 / 3)
    assert got["maj@2"] == pytest.approx(1 / 3)
    assert got["maj@4"] == pytest.approx(2 / 3)
    assert got["mean_length"] == pytest.approx((100 + 64 + 10) / 12)
    assert got["length_cut_fraction"] == pytest.approx(5 / 12)


def test_k_values_and_uneven_tables() -> None:
    assert k_values(1) == [1] and k_values(4) == [1, 2, 4] and k_values(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="same 2 samples"):
        summarize([ProblemSamples([1, 0], ["a", "b"], [1, 1], [0, 0]),
                   ProblemSamples([1], ["a"], [1], [0])])  # fmt: skip
