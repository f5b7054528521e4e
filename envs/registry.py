"""The factory of environments: `make_env(name, **options)` gives a fresh one per episode."""

from __future__ import annotations

from typing import Any

from envs.base import Environment
from envs.calculator import CalculatorEnv
from envs.countdown import CountdownEnv

ENVIRONMENTS: dict[str, type[Environment]] = {
    cls.name: cls for cls in (CalculatorEnv, CountdownEnv)
}


def make_env(name: str, **options: Any) -> Environment:
    """A new environment `name` (one episode) built with `options`.

    Raises:
        ValueError: an unknown name (the known ones listed).
    """
    cls = ENVIRONMENTS.get(name)
    if cls is None:
        raise ValueError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}")
    return cls(**options)
