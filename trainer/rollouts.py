"""Rollouts as the trainer sees them: one prompt's group of sampled completions.

These are plain host-side records (Python lists, no arrays), made from the gateway's groups by
`trainer.rollout_source`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion (token-in, token-out).

    Attributes:
      token_ids: the C sampled token ids (int), EOS included when the engine stopped on it.
      logprobs: C floats, log-prob of each sampled token under the sampling distribution (the
        engine's processed log-probs, after temperature), aligned with `token_ids`.
      finish_reason: why generation ended, e.g. "stop" (EOS or stop string), "length", "abort".
      version_start: weight version when the first token was sampled.
      version_end: weight version when the last token was sampled (>= version_start).
      reward: the verifier's score, None until scored.
      text: the decoded completion, if the engine sent it (the verifier may decode instead).
      forced_positions: indices into `token_ids` of tokens the engine wrote without sampling
        them (the JAX engine's end-of-think phrase at a reasoning budget); `build_rl_batch`
        keeps them out of the loss mask, since the policy never chose them.

    Raises:
      ValueError: if lengths differ, versions are negative or out of order, finish_reason is
        empty, or a forced position is outside the completion.
    """

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    finish_reason: str
    version_start: int
    version_end: int
    reward: float | None = None
    text: str | None = None
    forced_positions: Sequence[int] = ()

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"token_ids and logprobs must align; got {len(self.token_ids)} ids and "
                f"{len(self.logprobs)} log-probs"
            )
        if not 0 <= self.version_start <= self.version_end:
            raise ValueError(
                "need 0 <= version_start <= version_end; got "
                f"{self.version_start}, {self.version_end}"
            )
        if not self.finish_reason:
            raise ValueError("finish_reason must be a non-empty string")
        if any(not 0 <= j < len(self.token_ids) for j in self.forced_positions):
            raise ValueError(
                f"forced_positions must index the {len(self.token_ids)} completion tokens; "
                f"got {list(self.forced_positions)[:8]}"
            )


@dataclasses.dataclass(frozen=True)
class RolloutGroup:
    """The G completions sampled from one prompt.

    Attributes:
      sample_id: the id the trainer gave the prompt when submitting it (links to its answer).
      prompt_ids: the prompt's token ids (at least one).
      completions: the G >= 1 completions.

    Raises:
      ValueError: for an empty prompt or an empty group.
    """

    sample_id: str
    prompt_ids: Sequence[int]
    completions: Sequence[Completion]

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError(f"group {self.sample_id!r}: prompt_ids must not be empty")
        if len(self.completions) == 0:
            raise ValueError(f"group {self.sample_id!r}: needs at least one completion")

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
