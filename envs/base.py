"""The environment seam: one small interface, one file per environment, one factory
(`envs.registry`).

An episode alternates model turns and observations:

    observation_0 = env.reset(task)            # the first user message (text)
    model turn 1 -> env.step(turn_1_text)      # StepResult(observation_1, reward, done)
    model turn 2 -> env.step(turn_2_text)      # ... until done or a limit (`EpisodeLimits`)

An environment object holds one episode's state; make a new one per episode
(`envs.registry.make_env`). Environments see and return text only: the engine applies the chat
template's turn boundaries as token ids around the tokenized observation, and the model's own
tokens are never decoded and re-encoded (token in, token out). `step` must not raise on any
model text: a turn it cannot read is answered with an observation that says so.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the environment answers to one model turn.

    Attributes:
        observation: the text that goes back to the model as the next user (tool) message;
            None when `done`.
        reward: the environment's own score of the episode so far in [0, 1] (a game's checker
            after a guess), or None when the environment does not score: the problem's
            verifier then scores the episode's last model turn (the calculator, whose final
            answer is checked like a single-turn completion of the same problem).
        done: the episode ended (an answer was given, the game was solved or lost).
    """

    observation: str | None
    reward: float | None
    done: bool


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """Bounds of one episode, applied by whoever runs it.

    Attributes:
        max_turns: model turns at most (>= 1); the episode ends after the last one whatever
            the environment says.
        max_tokens: model plus observation tokens at most (>= 1), the first prompt excluded.
        max_observation_chars: an observation longer than this is cut to it (>= 1).
        step_timeout_s: seconds one `Environment.step` may take (> 0); past it the episode
            ends aborted (its thread is left to finish on its own: Python cannot stop one).
    """

    max_turns: int = 4
    max_tokens: int = 1024
    max_observation_chars: int = 1024
    step_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if min(self.max_turns, self.max_tokens, self.max_observation_chars) < 1:
            raise ValueError(f"every episode limit must be >= 1, got {self}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")


class Environment(abc.ABC):
    """One episode of a multi-turn task (see the module docstring).

    Subclasses set `name` (the registry key) and `stop_strings`: text at which a model turn
    should end so that the environment can answer (a tool call's closing tag); the episode
    runner ends the turn's record at the first one (`rollout_engine.episode.cut_at_stop`).
    Model text is untrusted: implementations bound what they parse and never hand it to
    `eval`, a shell or the file system.
    """

    name: ClassVar[str]
    stop_strings: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def reset(self, task: Mapping[str, Any]) -> str:
        """Start the episode of `task` (a problem's fields: "question", "answer", and what the
        environment needs besides, e.g. "entry" for reasoning-gym); returns the first user
        message.

        Raises:
            ValueError: the task lacks a field this environment needs.
        """

    @abc.abstractmethod
    def step(self, turn: str) -> StepResult:
        """Answer one model turn (its decoded text).

        Raises:
            RuntimeError: called before `reset` or after the episode ended.
        """
