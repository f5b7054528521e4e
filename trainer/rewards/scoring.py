"""Scoring rollout groups off the training thread, in a thread pool.

The training thread submits a group and gets a `concurrent.futures.Future` of the scored group;
verifiers run in worker threads (math-verify and reasoning-gym checkers are pure Python, so the
pool mostly overlaps them with JAX work, which releases the GIL).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from trainer.data.problem import Problem
from trainer.rewards.base import Verifier, final_turn, make_verifier
from trainer.rollouts import RolloutGroup

Decode = Callable[[Sequence[int]], str]


class ScoringPool:
    """A thread pool of verifiers, one instance per verifier name (made on first use).

    Args:
      max_workers: worker threads (>= 1).
      decode: token ids -> text, used for completions that carry no `text`.
      verifiers: ready verifiers by name, overriding the registry's defaults.

    Use as a context manager, or call `close`.
    """

    def __init__(
        self,
        *,
        max_workers: int = 2,
        decode: Decode | None = None,
        verifiers: Mapping[str, Verifier] | None = None,
    ):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1; got {max_workers}")
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="scoring")
        self._decode = decode
        self._verifiers: dict[str, Verifier] = dict(verifiers or {})
        self._lock = threading.Lock()

    def verifier(self, name: str) -> Verifier:
        """The pool's verifier for `name` (made from the registry on first use)."""
        with self._lock:
            if name not in self._verifiers:
                self._verifiers[name] = make_verifier(name)
            return self._verifiers[name]

    def _text(self, group: RolloutGroup, index: int) -> str:
        comp = group.completions[index]
        if comp.text is not None:
            return comp.text
        if self._decode is None:
            raise ValueError(
                f"group {group.sample_id!r} completion {index} has no text and the pool has no "
                "decode function"
            )
        return self._decoded(comp.token_ids)

    def _decoded(self, ids: np.ndarray) -> str:
        if self._decode is None:
            raise ValueError("an episode's last turn needs decoding and the pool has no decode")
        return self._decode(ids.tolist())

    def score_group(self, group: RolloutGroup, problem: Problem) -> RolloutGroup:
        """Score every completion of `group` against `problem`, in the calling thread.

        Completions are decoded only when the verifier reads text and they carry none. A
        multi-turn episode (`Completion.turns` >= 1) gets its environment's reward when the
        environment gave one, else `Verifier.score_episode` (by default the verifier's score
        of the last model turn, `final_turn`).

        Returns:
          A copy of `group` whose completions carry their rewards.

        Raises:
          ValueError: for a completion without text and no decode function (when text is
            needed), or from the verifier; KeyError: for an unknown verifier name.
        """
        verifier = self.verifier(problem.verifier)
        rewards = []
        for i, comp in enumerate(group.completions):
            if comp.turns and comp.env_reward is not None:  # the environment's own checker
                rewards.append(float(comp.env_reward))
            elif comp.turns:  # an episode: its last model turn is the answer
                text = self._decoded(final_turn(comp)) if verifier.needs_text else None
                rewards.append(verifier.score_episode(text, comp, problem))
            else:
                text = self._text(group, i) if verifier.needs_text else comp.text
                rewards.append(verifier.score_completion(text, comp.token_ids.tolist(), problem))
        return group.with_rewards(rewards)

    def score_async(self, group: RolloutGroup, problem: Problem) -> Future[RolloutGroup]:
        """`score_group` in a worker thread; the future raises what `score_group` raises."""
        return self._pool.submit(self.score_group, group, problem)

    def close(self) -> None:
        """Wait for submitted groups and stop the worker threads."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
