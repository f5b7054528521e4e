"""A calculator tool: the model writes ``<calc>EXPRESSION</calc>``, the environment answers
``<result>VALUE</result>``, and the episode ends on the first turn without a tool call, whose
answer the problem's own verifier scores (GSM8K's number, reasoning-gym's checker), as it would
a single-turn completion of the same problem.

The expression is computed by `envs.arith` (exact, bounded, no `eval`); one that it refuses is
answered ``<result>error: WHY</result>`` and the episode goes on. Engines end a model turn at
the closing tag (`stop_strings`); a turn cut at the limit with an open ``<calc>`` is read up
to its end.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

from envs.arith import DEFAULT_LIMITS, ArithLimits, ArithRefused, evaluate, format_value
from envs.base import Environment, StepResult

INSTRUCTIONS = (
    "You can use a calculator: write <calc>expression</calc> (numbers, + - * / // % ** and "
    "parentheses) and wait for its <result>; for example <calc>12*7</calc> is answered "
    "<result>84</result>. When you know the answer, write it as #### NUMBER without a "
    "calculator call."
)
_CALL = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.DOTALL)


class CalculatorEnv(Environment):
    """See the module docstring.

    Args:
        limits: bounds of each computation (`envs.arith.ArithLimits`).
        instructions: appended to the question in the first user message.
    """

    name: ClassVar[str] = "calculator"
    stop_strings: ClassVar[tuple[str, ...]] = ("</calc>",)

    def __init__(self, limits: ArithLimits = DEFAULT_LIMITS, instructions: str = INSTRUCTIONS):
        self.limits, self.instructions = limits, instructions
        self.calls = 0
        self._open = False

    def reset(self, task: Mapping[str, Any]) -> str:
        """The question and the tool's instructions.

        Raises:
            ValueError: the task has no "question".
        """
        question = task.get("question")
        if not isinstance(question, str) or not question:
            raise ValueError("the calculator needs a task with a non-empty 'question'")
        self.calls, self._open = 0, True
        return f"{question}\n\n{self.instructions}"

    def step(self, turn: str) -> StepResult:
        """A tool call's result, or the end of the episode (reward None: the verifier scores
        this last turn)."""
        if not self._open:
            raise RuntimeError("step() before reset() or after the episode ended")
        call = _CALL.search(turn)
        if call is None:
            self._open = False
            return StepResult(None, None, True)
        self.calls += 1
        try:
            value = format_value(evaluate(call.group(1), self.limits), self.limits)
        except ArithRefused as e:
            return StepResult(f"<result>error: {e}</result>", None, False)
        return StepResult(f"<result>{value}</result>", None, False)
