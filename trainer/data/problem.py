"""A training or evaluation problem: the prompt and what its verifier needs to score it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Problem:
    """A prompt with what its verifier needs.

    Attributes:
      problem_id: stable id (e.g. ``"gsm8k/test/17"``), used as the rollout's sample id prefix.
      question: the task text shown to the model (no chat template; the loop applies it).
      answer: the gold answer as text (GSM8K: the number after ``####``).
      verifier: the registry name of the verifier that scores completions of this problem.
      metadata: anything else the verifier needs (reasoning-gym: the whole dataset entry).
      max_new_tokens: this problem's own completion budget (tokens, >= 1) for training
        rollouts, capped by rollout.max_new_tokens; None: rollout.max_new_tokens (JSONL rows
        carry one through data.max_new_tokens_field).
    """

    problem_id: str
    question: str
    answer: str
    verifier: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_new_tokens: int | None = None
