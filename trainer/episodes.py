"""The trainer's side of multi-turn rollouts: which environment a run plays, and how each
problem becomes the first user message and the `gateway.messages.Episode` its prompt carries.

The engine plays the episode (`rollout_engine.episode`); the trainer only builds the prompt:
the environment's first observation (`envs.base.Environment.reset` of the problem's task) under
the chat template, and the episode's bounds. The task an environment reads is the problem's
fields as one JSON object: ``{"question", "answer", **metadata}`` (reasoning-gym problems carry
their whole entry as ``metadata["entry"]``, which the countdown game reads).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from envs.registry import make_env
from gateway import messages as m
from trainer.data.problem import Problem
from trainer.rollouts import RolloutGroup


def task_of(problem: Problem) -> dict[str, Any]:
    """The task an environment resets from: the problem's question, gold answer and metadata."""
    return {"question": problem.question, "answer": problem.answer, **problem.metadata}


def task_json(problem: Problem) -> str:
    """`task_of(problem)` as the JSON text it travels to the engine in.

    Raises:
        ValueError: the metadata is not JSON.
    """
    try:
        return json.dumps(task_of(problem))
    except (TypeError, ValueError) as e:
        raise ValueError(f"problem {problem.problem_id}: its metadata is not JSON: {e}") from None


@dataclasses.dataclass(frozen=True)
class EpisodeSetup:
    """A run's episodes: environment `env` (`envs.registry`) with the bounds of each episode.

    Attributes:
        env: the environment's registry name ("calculator", "countdown").
        max_turns: model turns per episode at most (>= 1).
        max_tokens: tokens after the prompt per episode at most, model and observation tokens
            together (>= 1); each turn's `max_new_tokens` is cut to what is left.
        max_observation_chars: an observation is cut to this many characters (>= 1).
    """

    env: str
    max_turns: int
    max_tokens: int
    max_observation_chars: int

    def first_message(self, problem: Problem) -> str:
        """The first user message of `problem`'s episodes (the environment's reset text).

        Raises:
            ValueError: an unknown environment, or a task it refuses.
        """
        return make_env(self.env).reset(task_of(problem))

    def as_prompt_problem(self, problem: Problem) -> Problem:
        """`problem` with its question replaced by the first message, for the prompt encoder
        (the verifier reads the answer and metadata, which stay)."""
        return dataclasses.replace(problem, question=self.first_message(problem))

    def episode_of(self, problem: Problem) -> m.Episode:
        """The `Episode` the prompt of `problem` carries to the engine.

        Raises:
            ValueError: the task is not JSON.
        """
        return m.Episode(
            env=self.env,
            task_json=task_json(problem),
            max_turns=self.max_turns,
            max_tokens=self.max_tokens,
            max_observation_chars=self.max_observation_chars,
        )


def episode_metrics(groups: Sequence[RolloutGroup]) -> dict[str, float]:
    """Means over the multi-turn episodes among `groups` (empty when there are none):
    ``turns_per_episode`` (model turns), ``tool_calls_per_episode`` (observations: the
    calculator's results, a game's feedback), ``env_token_fraction`` (observation and template
    tokens, masked out of the loss, over all episode tokens) and ``env_reward_mean`` (over the
    episodes whose environment scored them, when any did)."""
    episodes = [c for g in groups for c in g.completions if c.turns]
    if not episodes:
        return {}
    tokens = sum(len(c.token_ids) for c in episodes)
    out = {
        "turns_per_episode": float(np.mean([c.turns for c in episodes])),
        "tool_calls_per_episode": float(np.mean([c.observations for c in episodes])),
        "env_token_fraction": sum(len(c.forced_positions) for c in episodes) / max(tokens, 1),
    }
    scored = [c.env_reward for c in episodes if c.env_reward is not None]
    if scored:
        out["env_reward_mean"] = float(np.mean(scored))
    return out
