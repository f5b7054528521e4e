"""The verifier seam: one `Verifier` interface scoring a `Problem`'s completions, one registry.

Adding a verifier is one file with a `Verifier` (or `TextVerifier`) subclass decorated with
`@register_verifier`, imported in `trainer/rewards/__init__.py`. Each problem names its verifier,
so one run can mix task families.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np

from gateway.messages import Completion
from trainer.data.problem import Problem


class Verifier(abc.ABC):
    """Scores one completion against one problem. Implementations must be thread-safe.

    `needs_text` says whether `score_completion` reads the decoded text (the scoring pool then
    decodes completions that came without it) or only the token ids.
    """

    name: ClassVar[str]
    needs_text: ClassVar[bool] = True

    @abc.abstractmethod
    def score_completion(
        self, text: str | None, token_ids: Sequence[int], problem: Problem
    ) -> float:
        """The reward of one completion (its decoded `text`, or None, and its token ids).

        Raises:
          ValueError: if `problem` lacks what this verifier needs, or the text is needed and None.
        """

    def score_episode(
        self, final_text: str | None, completion: Completion, problem: Problem
    ) -> float:
        """The reward of a multi-turn episode (`completion.turns` >= 1) whose environment
        gave no reward of its own: by default `score_completion` of its last model turn
        (`final_turn`: the answer after the last tool result or feedback, as a single-turn
        completion of the same problem would give it). Override to read the whole episode
        (its turns, observations, every token).

        Args:
            final_text: the last model turn decoded (None when this verifier reads no text).
            completion: the episode's record: token ids [L], `forced_positions` (the
                environment's tokens), `turns`, `observations`.

        Raises:
            ValueError: as `score_completion`.
        """
        return self.score_completion(final_text, final_turn(completion).tolist(), problem)


def final_turn(completion: Completion) -> np.ndarray:
    """int32 [L']: the token ids of an episode's last model turn: those after its last forced
    token (the last observation's tokens, or a phrase the engine forced in that turn); the
    whole completion when nothing was forced."""
    forced = completion.forced_positions
    return completion.token_ids[forced[-1] + 1 :] if forced else completion.token_ids


class TextVerifier(Verifier):
    """A verifier that reads only the decoded completion text (implement `score`)."""

    def score_completion(
        self, text: str | None, token_ids: Sequence[int], problem: Problem
    ) -> float:
        """`score(text, problem)`.

        Raises:
          ValueError: if `text` is None.
        """
        if text is None:
            raise ValueError(f"verifier {self.name!r} needs the completion text; got None")
        return self.score(text, problem)

    @abc.abstractmethod
    def score(self, completion: str, problem: Problem) -> float:
        """The reward of `completion` (decoded text) for `problem`, a float (usually in [0, 1]).

        Raises:
          ValueError: if `problem` lacks what this verifier needs.
        """


_VERIFIERS: dict[str, type[Verifier]] = {}

V = TypeVar("V", bound=type[Verifier])


def register_verifier(cls: V) -> V:
    """Class decorator: register `cls` under `cls.name`.

    Raises:
      ValueError: if another class already holds that name.
    """
    if cls.name in _VERIFIERS and _VERIFIERS[cls.name] is not cls:
        raise ValueError(f"verifier {cls.name!r} is already registered")
    _VERIFIERS[cls.name] = cls
    return cls


def available_verifiers() -> tuple[str, ...]:
    """The registered verifier names, sorted."""
    return tuple(sorted(_VERIFIERS))


def make_verifier(name: str, **kwargs: Any) -> Verifier:
    """Build the verifier registered as `name`.

    Raises:
      KeyError: for an unknown name (the message lists the known ones).
    """
    if name not in _VERIFIERS:
        raise KeyError(f"unknown verifier {name!r}; expected one of {available_verifiers()}")
    return _VERIFIERS[name](**kwargs)
