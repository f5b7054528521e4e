"""A reward on token ids alone: the fraction of completion tokens equal to one chosen token.

Meant for learning tests with a tiny random model: chance level is about 1 / V, a policy that
learns to emit the token reaches 1, and no tokenizer or decoding is involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from trainer.data.problem import Problem
from trainer.rewards.base import Verifier, register_verifier


@register_verifier
class TokenFractionVerifier(Verifier):
    """Reward = (# completion tokens equal to the target id) / (# completion tokens); 0 if empty.

    The target id is ``problem.metadata["token_id"]`` when present, else the constructor's.

    Args:
      token_id: default target token id (>= 0), or None to require it in every problem.
      ignore_ids: ids left out of both counts (e.g. EOS, so stopping early is not penalised).
    """

    name: ClassVar[str] = "token_fraction"
    needs_text: ClassVar[bool] = False

    def __init__(self, *, token_id: int | None = None, ignore_ids: Sequence[int] = ()):
        if token_id is not None and token_id < 0:
            raise ValueError(f"token_id must be >= 0; got {token_id}")
        self.token_id = token_id
        self.ignore_ids = frozenset(int(i) for i in ignore_ids)

    def score_completion(
        self, text: str | None, token_ids: Sequence[int], problem: Problem
    ) -> float:
        """The fraction in [0, 1] (see the class docstring).

        Raises:
          ValueError: if neither the problem nor the verifier names a target id.
        """
        target = problem.metadata.get("token_id", self.token_id)
        if target is None:
            raise ValueError(
                f"problem {problem.problem_id}: no metadata['token_id'] and no default token_id"
            )
        counted = [t for t in token_ids if t not in self.ignore_ids]
        if not counted:
            return 0.0
        return sum(1 for t in counted if t == target) / len(counted)
