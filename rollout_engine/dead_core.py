"""A backend whose inference core died while the engine process lives.

vLLM runs its engine core in another process: when that process dies (a kernel it cannot run,
an out-of-memory kill), every later `generate` raises `vllm.v1.engine.exceptions.
EngineDeadError` ("EngineCore encountered an issue ...") while the engine process, its
heartbeat and its leases live on. Releasing each prompt and leasing the next would circle the
queue until the gateway aborts the prompts, so the worker stops instead (`rollout_engine.
worker`: it releases what it holds, deregisters and the process exits non-zero, which the
launcher restarts within its retry bound).

`is_dead_core(err)` tells such an error from a failure of one request: `BackendDead` (a
backend may raise it itself), an exception class named ``EngineDeadError`` (vLLM's, matched by
name so nothing here imports vLLM), or a message saying the engine core is gone; the error's
causes (``__cause__``, ``__context__``) count too.
"""

from __future__ import annotations

import re

_DEAD_NAMES = frozenset({"EngineDeadError", "BackendDead"})
_DEAD_TEXT = re.compile(
    r"engine ?core (encountered an issue|(is |has )?(dead|died|gone|not running))",
    re.IGNORECASE,
)


class BackendDead(RuntimeError):
    """The backend's inference core is gone for good: no later request can succeed."""


def is_dead_core(err: BaseException) -> bool:
    """True when `err` (or an exception it was raised from) says the backend's core is dead
    (see the module docstring); False for any other failure."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, BackendDead) or type(e).__name__ in _DEAD_NAMES:
            return True
        if _DEAD_TEXT.search(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False
