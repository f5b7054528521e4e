"""Sampling metrics of an evaluation: pass@k, maj@k, completion length, length cut-offs.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained
on Code", eq. 1): with n samples of which c are correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``,
computed as the product ``prod_{i=n-c+1}^{n} (1 - k / i)`` (their numerically stable form, no
large binomials). pass@1 is the mean score.

maj@k (majority voting, Wang et al. 2022 "Self-Consistency"): the answer extracted most often
among the *first* k samples is the problem's answer, scored as any sample carrying it. Ties go
to the answer whose first occurrence comes earliest in sample order; samples without an
extracted answer do not vote; a problem where none of the k has an answer scores 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with `c` correct samples out of `n` (Chen et al.
    2021, eq. 1, product form): ``1 - C(n-c, k)/C(n, k)``.

    Raises:
      ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def maj_at_k(answers: Sequence[str | None], scores: Sequence[float], k: int) -> float:
    """The score of the majority answer among the first `k` samples (ties: the answer seen
    first; None answers do not vote; 0.0 when none of the k has one).

    Args:
      answers: n extracted answers (a canonical string, or None), in sample order.
      scores: the n samples' scores (0/1 for a math verifier).

    Raises:
      ValueError: lengths differ, or k is outside [1, n].
    """
    if len(answers) != len(scores):
        raise ValueError(f"{len(answers)} answers but {len(scores)} scores")
    if not 1 <= k <= len(answers):
        raise ValueError(f"need 1 <= k <= n={len(answers)}; got k={k}")
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, answer in enumerate(answers[:k]):
        if answer is None:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        first.setdefault(answer, i)
    if not counts:
        return 0.0
    best = max(counts, key=lambda a: (counts[a], -first[a]))
    return float(scores[first[best]])


def k_values(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


@dataclasses.dataclass(frozen=True)
class ProblemSamples:
    """The n samples of one problem.

    Attributes:
      scores: n floats (the verifier's rewards). answers: n extracted answers or None.
      lengths: n completion lengths in tokens. cut: n bools, True where the completion ended at
        the length limit (finish_reason "length").
    """

    scores: Sequence[float]
    answers: Sequence[str | None]
    lengths: Sequence[int]
    cut: Sequence[bool]


def summarize(problems: Sequence[ProblemSamples]) -> dict[str, float | int]:
    """Aggregate metrics over problems that all have the same n samples.

    Returns:
      ``{"problems", "samples", "pass@1", "pass@k" for k in `k_values(n)`, "maj@k" for the same
      k, "mean_length" (tokens, over every completion), "length_cut_fraction"}``; pass@k counts
      a sample as correct when its score is >= 0.5 (verifiers give 0 or 1); pass@1 is the
      mean score itself.

    Raises:
      ValueError: no problems, or problems with different sample counts.
    """
    if not problems:
        raise ValueError("summarize needs at least one problem")
    n = len(problems[0].scores)
    if any(len(p.scores) != n for p in problems):
        raise ValueError(f"every problem needs the same {n} samples")
    out: dict[str, float | int] = {"problems": len(problems), "samples": n}
    out["pass@1"] = float(np.mean([np.mean(p.scores) for p in problems]))
    for k in k_values(n):
        if k > 1:
            out[f"pass@{k}"] = float(
                np.mean([pass_at_k(n, sum(s >= 0.5 for s in p.scores), k) for p in problems])
            )
        out[f"maj@{k}"] = float(np.mean([maj_at_k(p.answers, p.scores, k) for p in problems]))
    lengths = [x for p in problems for x in p.lengths]
    out["mean_length"] = float(np.mean(lengths))
    out["length_cut_fraction"] = float(np.mean([bool(x) for p in problems for x in p.cut]))
    return out
