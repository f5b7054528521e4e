"""A background thread that keeps an engine's heartbeat going and keeps the latest answer.

Each heartbeat is a long poll, so a newly published version reaches the engine at once (via
`on_sync`, or `latest.sync`), not at the next tick. `error` holds the last failure; a
NOT_FOUND means the gateway dropped the engine (register again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gateway import messages as m
from gateway.client import GatewayClient
from gateway.errors import NOT_FOUND, RESOURCE_EXHAUSTED, GatewayError

_BUSY_RETRY_S = 0.1  # a heartbeat the gateway was too busy to admit is retried this soon


class HeartbeatThread:
    """Keeps `client.heartbeat(...)` going as a long poll of `interval_s` seconds.

    Args:
        client: an engine-role client.
        engine_id: the registered engine.
        interval_s: seconds between heartbeats (> 0), e.g. `Registration.heartbeat_interval_s`.
        active_prompts: returns how many prompts the engine works on (status only).
        on_sync: called from the thread, once per new target version or new plan of it (the
            trainer re-planned a version after a data-plane member died: its `group` param
            changed), as soon as the trainer publishes it (the engine's cue to reach a safe
            point and load it).

    A failed heartbeat is kept in `error` and retried at the next tick (after 0.1 s for a
    RESOURCE_EXHAUSTED: the gateway had no room for one more call); a NOT_FOUND (the gateway
    dropped the engine) or a shutting-down answer stops the thread. A heartbeat answered
    before `interval_s` with no news (the gateway had no room for one more waiting
    heartbeat) is followed by a pause for the rest of the interval, never by a busy loop.
    `beats` and `failures` count the answered and the failed heartbeats.
    """

    def __init__(
        self,
        client: GatewayClient,
        engine_id: str,
        interval_s: float,
        active_prompts: Callable[[], int] = lambda: 0,
        on_sync: Callable[[m.SyncDirective], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: expected > 0 seconds, got {interval_s}")
        self._client = client
        self._engine_id = engine_id
        self._interval_s = interval_s
        self._active_prompts = active_prompts
        self._on_sync = on_sync
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self.latest: m.Heartbeat | None = None
        self.error: Exception | None = None
        self.beats = 0
        self.failures = 0

    def start(self) -> HeartbeatThread:
        """Start beating; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and wait up to `timeout_s` seconds for the thread."""
        self._stop.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def _loop(self) -> None:
        known, known_group = 0, ""
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:  # a long poll: returns early when a new sync directive appears
                beat = self._client.heartbeat(
                    self._engine_id, self._active_prompts(), self._interval_s, known
                )
                self.latest, self.error = beat, None
                self.beats += 1
                if beat.shutting_down:
                    return
                d = beat.sync
                group = d.params.get("group", "") if d is not None else ""
                if d is not None and (
                    d.target_version > known or (d.target_version == known and group != known_group)
                ):
                    known, known_group = d.target_version, group
                    if self._on_sync is not None:
                        self._on_sync(d)
                    continue
                self._stop.wait(self._interval_s - (time.monotonic() - t0))
            except GatewayError as e:
                self.error = e
                self.failures += 1
                if e.code == NOT_FOUND:
                    return
                busy = e.code == RESOURCE_EXHAUSTED
                self._stop.wait(_BUSY_RETRY_S if busy else self._interval_s)
            except ValueError as e:  # grpc raises it for a call on a closed channel
                self.error = e
                return
