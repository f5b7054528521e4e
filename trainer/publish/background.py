"""The background pusher: the loop hands each new weight version over and trains on; a thread
pushes the newest version handed over to the engines (`sync.background`, issue 26 item 4).

`offer(model, version)` copies the params to host buffers (the bytes have left the train state,
whose buffers the next train step donates) and returns; the thread pushes the newest copy with
the publisher's own `push` (publish, send, wait for every engine's LOADED ack: each engine's
committed version). A version offered while a push is in flight waits; one offered after it
replaces it unpushed (it is *skipped*: no engine ever loads it), so a slow engine holds back
the pushes, never the train steps. The loop bounds staleness itself (prompts' `min_version`, the
lag filter: `trainer.loop`).

Faults: a push that raises ends the thread; the error is kept and raised by the loop's next
`check` or `offer` (`PusherFailed`, the push's error chained), so the loop fails clearly rather
than waiting for rollouts that will not come. `close` cancels a push in flight (the publisher's
`cancel_push`, when it has one: its waits end at once) and joins the thread.

The host copies are the model's bytes at most twice more (the copy in flight and the pending
one), reused across versions (no page faults after the first two).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import numpy as np

from trainer.publish.host_views import flat_of, host_copies

log = logging.getLogger("trainer.publish")


class Pushes(Protocol):
    """What the pusher drives: `trainer.publish.WeightPublisher` (its `push` takes flat host
    params by dot path; `cancel_push`, if present, ends a push in flight)."""

    def push(self, model_or_params: Any, version: int) -> Any: ...


class PusherFailed(RuntimeError):
    """A background push failed (or the pusher was closed); the cause is chained.

    Attributes:
        version: the version whose push failed (0 when closed).
    """

    def __init__(self, version: int, message: str) -> None:
        super().__init__(message)
        self.version = version


class BackgroundPusher:
    """Pushes the newest offered version on its own thread (see the module docstring).

    Args:
        publisher: pushes one version and returns once every engine committed it.
        committed: the version the engines serve now (a resumed run's), before any offer.

    Attributes:
        committed: the last version whose push returned (every live engine loaded it).
        pushed: versions pushed, in order. skipped: versions offered and never pushed.
        last_stats: the last push's result (`trainer.publish.PushStats` for the publisher).
    """

    def __init__(self, publisher: Pushes, committed: int = 0) -> None:
        self.publisher = publisher
        self.committed = committed
        self.pushed: list[int] = []
        self.skipped: list[int] = []
        self.last_stats: Any = None
        self._cv = threading.Condition()
        self._pending: tuple[int, dict[str, np.ndarray]] | None = None
        self._in_flight: int | None = None
        self._spare: dict[str, np.ndarray] = {}
        self._error: PusherFailed | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="background-push", daemon=True)

    def start(self) -> BackgroundPusher:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """Whether the push thread runs."""
        return self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """Whether a push failed (`check` raises it)."""
        return self._error is not None

    @property
    def in_flight(self) -> int | None:
        """The version being pushed now, if any."""
        return self._in_flight

    def offer(self, model_or_params: Any, version: int) -> float:
        """Hand `version` over: copy its params (a `Decoder`, or flat params by dot path) to
        host buffers, queue it for the thread, replacing (skipping) a version still queued.
        Returns the seconds the copy took (the loop's only wait on a push).

        Raises:
            PusherFailed: an earlier push failed, or the pusher is closed.
            ValueError: `version` not above the last one offered.
        """
        self.check()
        t0 = time.perf_counter()
        with self._cv:
            spare, self._spare = self._spare, {}
            if self._pending is not None:
                old, spare = self._pending
                self._pending = None
                self.skipped.append(old)
        last = max(self.committed, self._in_flight or 0, *self.pushed[-1:], *self.skipped[-1:])
        if version <= last:
            raise ValueError(f"version: expected > {last} (the last one offered), got {version}")
        merged = getattr(self.publisher, "adapter", None) is None  # adapters: A and B as held
        copy = host_copies(flat_of(model_or_params, merged=merged).items(), spare)
        with self._cv:
            self._pending = (version, copy)
            self._cv.notify_all()
        return time.perf_counter() - t0

    def check(self) -> None:
        """Raise the push thread's failure, if any.

        Raises:
            PusherFailed: a push failed (its error chained), or the pusher is closed.
        """
        if self._error is not None:
            raise self._error
        if self._closed:
            raise PusherFailed(0, "the background pusher is closed")

    def flush(self, timeout_s: float) -> None:
        """Wait until every offered version is pushed or skipped and no push is in flight
        (the engines serve the newest), at most `timeout_s` seconds.

        Raises:
            PusherFailed: a push failed.
            TimeoutError: pushes still ran after `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._error is None and (self._pending or self._in_flight is not None):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"background pushes still running after {timeout_s:g} s (version "
                        f"{self._in_flight} in flight, committed {self.committed})"
                    )
                self._cv.wait(min(left, 0.5))
        self.check()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop: drop the queued version, cancel a push in flight (`cancel_push` of the
        publisher, if it has one) and join the thread (at most `timeout_s` seconds).

        Raises:
            RuntimeError: the thread still runs after `timeout_s` (a push that cannot be
                cancelled, e.g. a collective send blocked on a dead peer, past its timeout).
        """
        with self._cv:
            self._closed = True
            if self._pending is not None:
                self.skipped.append(self._pending[0])
                self._pending = None
            self._cv.notify_all()
            busy = self._in_flight is not None
        cancel = getattr(self.publisher, "cancel_push", None)
        if busy and cancel is not None:
            cancel()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the background push thread still runs after {timeout_s:g} s")

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                assert self._pending is not None
                version, params = self._pending
                self._pending = None
                self._in_flight = version
            try:
                stats = self.publisher.push(params, version)
            except BaseException as e:  # noqa: BLE001 - kept for the loop to raise
                with self._cv:
                    self._in_flight = None
                    cancelled = self._closed
                    if not cancelled:
                        self._error = PusherFailed(
                            version, f"background push of version {version} failed: {e}"
                        )
                        self._error.__cause__ = e
                    self._cv.notify_all()
                if not cancelled:
                    log.error("background push of version %d failed: %s", version, e)
                return
            with self._cv:
                self.committed, self.last_stats = version, stats
                self.pushed.append(version)
                self._in_flight = None
                if not self._spare:
                    self._spare = params
                self._cv.notify_all()
