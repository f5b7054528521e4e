"""Gateway calls from asyncio: each blocking `GatewayClient` call runs on a small thread pool,
and an unreachable gateway is retried with backoff for a bounded time before it counts as lost.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.errors import (
    DEADLINE_EXCEEDED,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    GatewayError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# Codes that say "the gateway did not answer" or "not now" (worth retrying), not "the gateway
# said no": RESOURCE_EXHAUSTED is the gateway's cap on concurrent calls and long polls
# (`gateway.admission`), a busy gateway rather than a refusal.
RETRYABLE = (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED)


class GatewayLost(RuntimeError):
    """The gateway did not answer for longer than the retry window."""


class EngineDropped(RuntimeError):
    """The gateway no longer knows this engine (NOT_FOUND): it missed its heartbeats."""


class GatewayCaller:
    """Runs gateway calls on `threads` threads, retrying the `RETRYABLE` codes.

    Args:
        retry_s: seconds of failed attempts after which a call raises `GatewayLost` (> 0).
        threads: concurrent blocking calls (a lease long poll, a return, an ack, ...).
    """

    def __init__(self, retry_s: float, threads: int = 4) -> None:
        if retry_s <= 0:
            raise ValueError(f"retry_s: expected > 0 seconds, got {retry_s}")
        self.retry_s = retry_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gateway-call")

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the pool.

        Raises:
            GatewayLost: no answer for `retry_s` seconds.
            EngineDropped: the gateway answered NOT_FOUND for this engine.
            GatewayError: any other refusal, unchanged.
        """
        loop = asyncio.get_running_loop()
        first_failure: float | None = None
        delay = 0.1
        while True:
            try:
                return await loop.run_in_executor(
                    self._pool, functools.partial(fn, *args, **kwargs)
                )
            except GatewayError as e:
                if e.code == NOT_FOUND:
                    raise EngineDropped(str(e)) from e
                if e.code not in RETRYABLE:
                    raise
                now = time.monotonic()
                first_failure = first_failure or now
                if now - first_failure >= self.retry_s:
                    raise GatewayLost(
                        f"no gateway answer for {now - first_failure:.1f} s "
                        f"(retry window {self.retry_s} s): {e}"
                    ) from e
                log.warning("gateway call %s failed (%s); retrying in %.1f s", fn, e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

    def close(self) -> None:
        """Stop the pool (calls still running finish in their threads)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
