"""One JSONL row per evaluated problem, and the metrics recomputed from such rows.

A row: ``{"problem_id", "prompt" (the chat-templated prompt text), "question", "gold",
"completions" (decoded texts), "answers" (extracted final answers or null), "scores",
"lengths" (tokens), "finish_reasons"}``. `summary_from_rows` gives exactly the metrics
`trainer.eval.metrics.summarize` gives for the same samples, so a saved file can be rescored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainer.data.problem import Problem
from trainer.eval.metrics import ProblemSamples, summarize
from trainer.rollouts import RolloutGroup


def canonical_answer(parsed: Sequence[Any]) -> str | None:
    """The voting key of a math-verify parse (``[value, text]``): a finite number as ``%.12g``
    (so "27", "27.0" and "27.00" vote together), else the value's sympy string; None for an
    empty parse."""
    if not parsed:
        return None
    value = parsed[0]
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f"{number:.12g}" if math.isfinite(number) else str(value)


def problem_row(
    problem: Problem,
    prompt: str,
    group: RolloutGroup,
    decode: Callable[[Sequence[int]], str],
    extract: Callable[[str], Sequence[Any]],
) -> dict[str, Any]:
    """The JSONL row of one scored group (see the module docstring).

    Args:
      prompt: the prompt text the engine saw. decode: token ids -> text.
      extract: completion text -> math-verify parse of its final answer.

    Raises:
      ValueError: a completion without a reward.
    """
    texts = [c.text if c.text is not None else decode(list(c.token_ids)) for c in group.completions]
    return {
        "problem_id": problem.problem_id,
        "prompt": prompt,
        "question": problem.question,
        "gold": problem.answer,
        "completions": texts,
        "answers": [canonical_answer(extract(t)) for t in texts],
        "scores": group.rewards,
        "lengths": [len(c.token_ids) for c in group.completions],
        "finish_reasons": [c.finish_reason for c in group.completions],
    }


def summary_from_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | int]:
    """`summarize` over rows as written by `problem_row` (or read back from the JSONL file).

    Raises:
      ValueError: as `summarize`; KeyError: a row lacking one of the row's keys.
    """
    return summarize(
        [
            ProblemSamples(
                scores=r["scores"],
                answers=r["answers"],
                lengths=r["lengths"],
                cut=[f == "length" for f in r["finish_reasons"]],
            )
            for r in rows
        ]
    )
