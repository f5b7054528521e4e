"""The loss registry: one name per loss class, one factory.

Adding a loss is one file with a `PolicyLoss` subclass decorated with `@register_loss`, plus its
import in `trainer/losses/__init__.py`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from trainer.losses.base import PolicyLoss

_LOSSES: dict[str, type[PolicyLoss]] = {}

L = TypeVar("L", bound=type[PolicyLoss])


def register_loss(cls: L) -> L:
    """Class decorator: register `cls` under `cls.name`.

    Raises:
      ValueError: if another class already holds that name.
    """
    name = cls.name
    if name in _LOSSES and _LOSSES[name] is not cls:
        raise ValueError(f"loss {name!r} is already registered by {_LOSSES[name].__qualname__}")
    _LOSSES[name] = cls
    return cls


def available_losses() -> tuple[str, ...]:
    """The registered loss names, sorted."""
    return tuple(sorted(_LOSSES))


def make_loss(name: str, **kwargs: Any) -> PolicyLoss:
    """Build the loss registered as `name` with its keyword arguments (see each class).

    Raises:
      KeyError: for an unknown name (the message lists the known ones).
    """
    if name not in _LOSSES:
        raise KeyError(f"unknown loss {name!r}; expected one of {available_losses()}")
    return _LOSSES[name](**kwargs)
