"""Waits that fail on silence, not on slowness: a `SilenceClock` runs out only when nothing
arrived for `timeout_s` seconds, however long the whole wait takes; `engines_line` says, for the
error, which engines the gateway knows and what each was doing.

Used by the evaluation and the drain after a stop (`trainer.launch.evaluate`): a loaded machine
or an engine slowed for a while makes them slower, never fail; an engine stopped (or hung) for
longer than the timeout fails them with a message naming what was waited for, how much came and
from whom, and the config key that sets the timeout.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any


class SilenceClock:
    """Tracks the last progress of a wait.

    Args:
      timeout_s: seconds of silence allowed (> 0).
      key: the config key that sets it (named in errors), e.g. "eval.timeout_s".

    Raises:
      ValueError: `timeout_s` <= 0.
    """

    def __init__(self, timeout_s: float, key: str) -> None:
        if timeout_s <= 0:
            raise ValueError(f"{key}: expected > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.key = key
        self.started = time.monotonic()
        self.last = self.started
        self.by_engine: Counter[str] = Counter()

    def progressed(self, engine_id: str = "", count: int = 1) -> None:
        """Record `count` items that arrived (from `engine_id`); restarts the silence."""
        if count > 0:
            self.last = time.monotonic()
            self.by_engine[engine_id or "?"] += count

    def left(self) -> float:
        """Seconds of silence left before the wait fails (<= 0: it has failed)."""
        return self.last + self.timeout_s - time.monotonic()

    def silent_s(self) -> float:
        """Seconds since the last progress."""
        return time.monotonic() - self.last

    def elapsed_s(self) -> float:
        """Seconds since the wait began."""
        return time.monotonic() - self.started

    def sources(self) -> str:
        """Who sent what so far: "engine-a: 3, engine-b: 1" or "nobody"."""
        if not self.by_engine:
            return "nobody"
        return ", ".join(f"{e}: {n}" for e, n in sorted(self.by_engine.items()))

    def expired(self, what: str, status: Any = None) -> TimeoutError:
        """The error of a wait that ran out: `what` was waited for (with its counts), the
        silence, the whole wait, who sent what, the config key and the engines' state."""
        line = f"; engines: {engines_line(status)}" if status is not None else ""
        return TimeoutError(
            f"{what}: nothing came back for {self.silent_s():.1f} s (silence limit "
            f"{self.key}={self.timeout_s:g}) after {self.elapsed_s():.1f} s in all; "
            f"came from {self.sources()}{line}"
        )


def engines_line(status: Any) -> str:
    """The engines of a gateway `StatusReply`, one clause each: id (name), last seen, leased
    prompts, groups returned; "none registered" when there is none."""
    engines = list(getattr(status, "engines", ()))
    if not engines:
        return "none registered"
    return "; ".join(
        f"{e.engine_id} ({e.name or e.backend}) last seen {e.last_seen_s:.1f} s ago, "
        f"{e.leased_prompts} prompts leased, {e.groups_returned} groups returned"
        for e in engines
    )
