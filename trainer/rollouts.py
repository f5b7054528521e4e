"""Rollouts as the trainer sees them: one prompt's group of sampled completions.

A completion is the engines' own record, `gateway.messages.Completion` (int32 token ids,
float32 log-probs, weight versions and their spans), scored here (`reward`); nothing converts
it between the backend and the batch (`trainer.batch`). A group adds the prompt's token ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from gateway.messages import Completion


@dataclasses.dataclass(frozen=True)
class RolloutGroup:
    """The G completions sampled from one prompt.

    Attributes:
      sample_id: the id the trainer gave the prompt when submitting it (links to its answer).
      prompt_ids: int32 [P] the prompt's token ids (P >= 1; a sequence becomes an array).
      completions: the G >= 1 completions (`Completion.validate` passed on each).
      engine_id: the engine that generated them, as the gateway named it ("" when unknown).

    Raises:
      ValueError: for an empty prompt, an empty group, a completion `Completion.validate`
        refuses (lengths that differ, versions out of order, a forced position outside it),
        or routed experts not of prompt + completion - 1 rows.
    """

    sample_id: str
    prompt_ids: np.ndarray
    completions: Sequence[Completion]
    engine_id: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", np.asarray(self.prompt_ids, np.int32))
        if len(self.prompt_ids) == 0:
            raise ValueError(f"group {self.sample_id!r}: prompt_ids must not be empty")
        if len(self.completions) == 0:
            raise ValueError(f"group {self.sample_id!r}: needs at least one completion")
        p = len(self.prompt_ids)
        for c in self.completions:
            c.validate()
            if c.routed_experts is not None and len(c.routed_experts) != p + len(c.token_ids) - 1:
                raise ValueError(
                    f"group {self.sample_id!r}: routed_experts must have prompt + completion - 1 "
                    f"= {p + len(c.token_ids) - 1} rows; got {len(c.routed_experts)}"
                )

    @property
    def version_start(self) -> int:
        """The oldest weight version any of its completions started at."""
        return min(c.version_start for c in self.completions)

    @property
    def rewards(self) -> list[float]:
        """The G rewards.

        Raises:
          ValueError: if a completion has not been scored.
        """
        missing = [i for i, c in enumerate(self.completions) if c.reward is None]
        if missing:
            raise ValueError(f"group {self.sample_id!r}: completions {missing} have no reward")
        return [float(c.reward) for c in self.completions]  # type: ignore[arg-type]

    def with_rewards(self, rewards: Sequence[float]) -> RolloutGroup:
        """A copy whose completions carry `rewards` (G floats, in order).

        Raises:
          ValueError: if len(rewards) != G.
        """
        if len(rewards) != len(self.completions):
            raise ValueError(
                f"group {self.sample_id!r}: expected {len(self.completions)} rewards, "
                f"got {len(rewards)}"
            )
        completions = [
            dataclasses.replace(c, reward=float(r))
            for c, r in zip(self.completions, rewards, strict=True)
        ]
        return dataclasses.replace(self, completions=completions)
