"""How many calls may wait at once: the long-poll caps that keep threads for short calls.

The server runs `max_concurrent_rpcs` threads and lets gRPC admit as many calls, so an
admitted call never queues for a thread. Of those threads, at most `long_poll_limit` may sit
in a waiting LeasePrompts, FetchRollouts, SubmitPrompts or WaitSync, and at most
`heartbeat_poll_limit` in a waiting Heartbeat; the rest serve calls that do not wait. A call
that would wait past its cap is refused with RESOURCE_EXHAUSTED at once, except a heartbeat,
which answers at once instead (it still counts as the engine's heartbeat).

Not thread-safe: `gateway.state.GatewayState` uses it under its lock.
"""

from __future__ import annotations

from gateway.errors import RESOURCE_EXHAUSTED, GatewayError


class WaitSlots:
    """Counts calls waiting now: long polls and heartbeats, each against its cap.

    Args:
        long_polls: most waiting calls other than heartbeats (>= 1).
        heartbeats: most waiting heartbeats (>= 1).
    """

    def __init__(self, long_polls: int, heartbeats: int) -> None:
        if long_polls < 1 or heartbeats < 1:
            raise ValueError(f"caps: expected >= 1, got {long_polls} and {heartbeats}")
        self.caps = {False: long_polls, True: heartbeats}
        self.waiting = {False: 0, True: 0}
        self.refused = 0

    def take(self, heartbeat: bool, what: str) -> bool:
        """Take a slot to wait in; False for a heartbeat past its cap (answer at once).

        Raises:
            GatewayError: RESOURCE_EXHAUSTED for a call other than a heartbeat past its cap;
                `what` (e.g. "FetchRollouts") names it in the message.
        """
        if self.waiting[heartbeat] >= self.caps[heartbeat]:
            if heartbeat:
                return False
            self.refused += 1
            raise GatewayError(
                RESOURCE_EXHAUSTED,
                f"{what}: expected at most max_long_polls={self.caps[False]} calls waiting at "
                f"once, got one more; retry later (or raise the gateway's max_long_polls)",
            )
        self.waiting[heartbeat] += 1
        return True

    def give(self, heartbeat: bool) -> None:
        """Give back a slot taken by `take`."""
        self.waiting[heartbeat] -= 1
