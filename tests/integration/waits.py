"""Start-up and exit waits for integration tests that hold on a loaded machine (loaded by path).

`wait_for` waits on progress and liveness, not on a fixed figure: it returns once `ready()`
gives something truthy, fails at once when a process it depends on exits, and gives up only at
a generous ceiling (30 minutes by default) meant to end a hung run, never to time a healthy one.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
CEILING_S = 1800.0


def wait_for(
    ready: Callable[[], T],
    alive: Sequence[subprocess.Popen],
    what: str,
    ceiling_s: float = CEILING_S,
    poll_s: float = 0.2,
) -> T:
    """Poll `ready()` every `poll_s` seconds until it returns something truthy; returns it.

    Raises:
      RuntimeError: a process of `alive` exited first (its pid and status inside);
      TimeoutError: `ceiling_s` seconds passed (a hung run, not a slow one).
    """
    end = time.monotonic() + ceiling_s
    while True:
        value = ready()
        if value:
            return value
        for proc in alive:
            code = proc.poll()
            if code is not None:
                raise RuntimeError(f"waiting for {what}: process {proc.pid} exited ({code})")
        if time.monotonic() > end:
            raise TimeoutError(f"waiting for {what}: still not there after {ceiling_s} s")
        time.sleep(poll_s)


def exit_status(proc: subprocess.Popen, what: str, ceiling_s: float = CEILING_S) -> int:
    """Wait for `proc` to exit (up to the ceiling); returns its status."""
    wait_for(lambda: proc.poll() is not None, [], what, ceiling_s)
    return int(proc.returncode)
