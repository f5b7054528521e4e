"""reasoning-gym tasks scored by their own checkers (`dataset.score_answer(answer, entry)`).

The answer is taken from an ``<answer>...</answer>`` tag when the completion has one (the
format reasoning-gym's prompts ask for), else from the completion's last non-empty line.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from trainer.data.problem import Problem
from trainer.rewards.base import TextVerifier, register_verifier

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str | None:
    """The last ``<answer>`` tag's content, else the last non-empty line; stripped; None if none."""
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1].strip()
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


@register_verifier
class ReasoningGymVerifier(TextVerifier):
    """Scores with the checker of the entry's source dataset (``metadata["source_dataset"]``).

    `Problem.metadata["entry"]` must hold the reasoning-gym entry (question, answer, metadata).
    Checkers are built once per dataset name (reasoning_gym.get_score_answer_fn) and cached.
    """

    name: ClassVar[str] = "reasoning_gym"

    def __init__(self) -> None:
        self._fns: dict[str, Callable[[Any, dict], float]] = {}
        self._lock = threading.Lock()

    def _score_fn(self, dataset: str) -> Callable[[Any, dict], float]:
        with self._lock:
            if dataset not in self._fns:
                import reasoning_gym

                self._fns[dataset] = reasoning_gym.get_score_answer_fn(dataset)
            return self._fns[dataset]

    def score(self, completion: str, problem: Problem) -> float:
        """The dataset checker's score in [0, 1] of the extracted answer.

        Raises:
          ValueError: if the problem has no reasoning-gym entry.
        """
        entry = problem.metadata.get("entry")
        if not isinstance(entry, dict) or "metadata" not in entry:
            raise ValueError(
                f"problem {problem.problem_id}: metadata['entry'] must be a reasoning-gym entry; "
                f"got {type(entry).__name__}"
            )
        fn = self._score_fn(entry["metadata"]["source_dataset"])
        return float(fn(extract_answer(completion), entry))
