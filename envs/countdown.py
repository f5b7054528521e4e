"""Countdown with feedback, a multi-turn game over reasoning-gym's ``countdown`` task: reach the
target from the given numbers with + - * /. After each guess the environment scores it with
reasoning-gym's own checker (`score_answer`); a solved game ends with reward 1, otherwise the
model is told what its expression equals (computed by `envs.arith`, never `eval`) against the
target, and guesses again, until the turn limit of whoever runs the episode.

The guess is the last ``<answer>...</answer>`` of the turn, else its last non-empty line (the
reasoning-gym convention, as `trainer.rewards.reasoning_gym_verifier` reads single-turn
answers), at most `max_guess_chars` characters.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from envs.arith import DEFAULT_LIMITS, ArithLimits, ArithRefused, evaluate, format_value
from envs.base import Environment, StepResult

FEEDBACK = (
    "After each guess you are told what your expression equals; guess again until it equals "
    "the target. Put each guess in <answer></answer>."
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def guess_of(turn: str, max_chars: int) -> str | None:
    """The guess of one model turn (see the module docstring), or None when it has none."""
    tags = _ANSWER.findall(turn)
    if tags:
        guess = tags[-1].strip()
    else:
        lines = [line.strip() for line in turn.strip().splitlines() if line.strip()]
        guess = lines[-1] if lines else ""
    return guess[:max_chars] if guess else None


class CountdownEnv(Environment):
    """See the module docstring.

    Args:
        max_guess_chars: a guess is cut to this many characters before it is read.
        limits: bounds of computing a guess's value.
    """

    name: ClassVar[str] = "countdown"
    stop_strings: ClassVar[tuple[str, ...]] = ("</answer>",)

    def __init__(self, max_guess_chars: int = 200, limits: ArithLimits = DEFAULT_LIMITS):
        self.max_guess_chars, self.limits = max_guess_chars, limits
        self.guesses = 0
        self._entry: dict[str, Any] | None = None
        self._score: Callable[[Any, dict], float] | None = None

    def reset(self, task: Mapping[str, Any]) -> str:
        """The reasoning-gym question and the rules of the feedback.

        Raises:
            ValueError: the task has no reasoning-gym countdown "entry".
        """
        entry = task.get("entry")
        meta = entry.get("metadata", {}) if isinstance(entry, Mapping) else {}
        if meta.get("source_dataset") != "countdown" or "target" not in meta:
            raise ValueError(
                "countdown needs a task whose 'entry' is a reasoning-gym countdown entry"
            )
        import reasoning_gym

        self._entry, self.guesses = dict(entry), 0  # type: ignore[arg-type]
        self._score = reasoning_gym.get_score_answer_fn("countdown")
        return f"{entry['question']}\n\n{FEEDBACK}"  # type: ignore[index]

    def step(self, turn: str) -> StepResult:
        """Score the guess; feedback and reward (the checker's score) while unsolved."""
        if self._entry is None or self._score is None:
            raise RuntimeError("step() before reset() or after the episode ended")
        self.guesses += 1
        guess = guess_of(turn, self.max_guess_chars)
        score = float(self._score(guess, self._entry))
        if score >= 1.0:
            self._entry = None
            return StepResult(None, 1.0, True)
        target = self._entry["metadata"]["target"]
        if guess is None:
            return StepResult(f"No guess found. The target is {target}.", score, False)
        try:
            value = format_value(evaluate(guess, self.limits), self.limits)
        except ArithRefused as e:
            return StepResult(f"Your guess could not be computed ({e}). The target is {target}.",
                              score, False)  # fmt: skip
        return StepResult(
            f"Your expression equals {value}, not {target} (or it breaks a rule). Try again.",
            score,
            False,
        )
