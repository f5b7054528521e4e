"""The publisher's waits on the engines during a push, through the gateway's sync state:
who is registered, who reached "ready" / "loaded", who failed, and which member a broken
collective is pinned on (see "Elastic pushes" in `trainer.publish.publisher`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gateway import messages as m
from gateway.client import GatewayClient

log = logging.getLogger("trainer.publish")


class PushError(RuntimeError):
    """A version did not reach every engine: no engines, an engine failed, or a timeout.

    Attributes:
        version: the version pushed.
        engines: the last sync state of each engine (`gateway.messages.EngineSyncState`).
    """

    def __init__(self, version: int, message: str, engines: tuple = ()) -> None:
        super().__init__(f"push of version {version}: {message}")
        self.version = version
        self.engines = engines


class MembersLost(Exception):
    """Members of the push's group left (their connection broke): re-plan without them."""

    def __init__(self, gone: list[str], when: str) -> None:
        super().__init__(f"engines {gone} left {when}")
        self.gone, self.when = gone, when


class EngineWaits:
    """Waits of one publisher on its engines (gateway `status` and `wait_sync` polls).

    Args:
        client: a trainer-role `GatewayClient`.
        collective: the data plane is one process group (gloo/NCCL): a dead member breaks it
            for all, so a member gone before the send, or a member's failure pinned on one
            that left, re-plans the push (`MembersLost`).
        min_engines: fewest engines a push may commit on.
        ready_timeout_s, loaded_timeout_s: silence limits of the two waits (seconds).
        settle_s: most seconds a re-plan waits for the survivors to end the broken attempt.
        peer_grace_s: most seconds a data-plane error waits for the gateway to drop the dead
            member (its connection broke), so the error can name it.
        is_far: answers True for the registered name of a far engine (a mixed plan,
            `transport.sync_plan.FarLeg`): far engines are no members of a push and are never
            waited for; None: every engine is a member.
    """

    def __init__(
        self,
        client: GatewayClient,
        collective: bool,
        min_engines: int,
        ready_timeout_s: float,
        loaded_timeout_s: float,
        settle_s: float,
        peer_grace_s: float,
        is_far: Callable[[str], bool] | None = None,
    ) -> None:
        self.is_far = is_far or (lambda name: False)
        self.client = client
        self.collective = collective
        self.min_engines = min_engines
        self.ready_timeout_s = ready_timeout_s
        self.loaded_timeout_s = loaded_timeout_s
        self.settle_s = settle_s
        self.peer_grace_s = peer_grace_s
        self.cancelled = threading.Event()

    def check_cancelled(self, version: int) -> None:
        """Raises PushError when `cancelled` is set (`WeightPublisher.cancel_push`: a stop
        while a push is in flight). Checked at each poll of the waits before the version is
        published (`live_engines`, `settle`) and after the send ("loaded"), never between: an
        engine that acked "ready" is entering the data plane's receive, and a sender gone then
        would leave it blocked there until the transport's timeout."""
        if self.cancelled.is_set():
            raise PushError(version, "cancelled (the trainer is stopping)")

    def live_engines(
        self, version: int, lost: list[str] | None = None
    ) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...]]:
        """The near engines registered now (every engine but the far ones, `is_far`): those
        that need `version`, as (id, TP size), and the ids of those that hold it already (an
        engine that loaded it, left during the push and registered again with it: it is
        served, and a send to it would wait for a receiver that never joins). Waits up to
        `ready_timeout_s` for `min_engines` of them in all (a restarted engine registering
        again). `lost`: the engines that left during this push (named in the error).

        Raises:
            PushError: fewer than `min_engines` within `ready_timeout_s`, or `cancelled`.
        """
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            self.check_cancelled(version)
            near = [e for e in self.client.status().engines if not self.is_far(e.name)]
            members = tuple(
                sorted((e.engine_id, max(1, e.tp_size)) for e in near if e.weight_version < version)
            )
            holding = tuple(sorted(e.engine_id for e in near if e.weight_version >= version))
            if len(members) + len(holding) >= self.min_engines:
                return members, holding
            if time.monotonic() > deadline:
                why = f" after {lost} left during the push" if lost else ""
                self.check_enough(version, len(near), f"within {self.ready_timeout_s} s{why}")
            time.sleep(0.2)

    def check_enough(self, version: int, serving: int, when: str) -> None:
        if serving < self.min_engines:
            raise PushError(
                version,
                f"expected at least launch.min_engines={self.min_engines} engines serving, "
                f"got {serving} {when}",
            )

    def settle(self, version: int, ids: tuple[str, ...]) -> None:
        """Before a re-plan: wait (at most `settle_s`) until each survivor ended its attempt
        on the broken group (acked "failed" or "loaded", or left), so its late failure of
        that attempt cannot count against the next one."""
        deadline = time.monotonic() + self.settle_s
        while time.monotonic() < deadline:
            self.check_cancelled(version)
            states = {s.engine_id: s for s in self.client.wait_sync(version, 0.0, "loaded").engines}
            if all(e not in states or states[e].phase in ("failed", "loaded") for e in ids):
                return
            time.sleep(0.05)

    def pin_on_lost(
        self, version: int, ids: tuple[str, ...], when: str, cause: BaseException | None = None
    ) -> tuple[m.EngineSyncState, ...]:
        """A collective failed (the send, or a member's receive): wait up to `peer_grace_s`
        for the gateway to drop members of `ids` (a dead rank breaks the group for all, and
        its broken connection names it a moment later). Returns the engines' sync states
        when none left.

        Raises:
            MembersLost: members of `ids` left (the push re-plans on the rest).
        """
        deadline = time.monotonic() + self.peer_grace_s
        while True:
            states, gone = self.left(version, ids)
            if gone:
                raise MembersLost(gone, when) from cause
            if time.monotonic() > deadline:
                return states
            time.sleep(0.1)

    def left(
        self, version: int, ids: tuple[str, ...]
    ) -> tuple[tuple[m.EngineSyncState, ...], list[str]]:
        """The sync states of the registered engines now, and the members of `ids` that are
        no longer registered (one gateway call, no wait)."""
        states = self.client.wait_sync(version, 0.0, "loaded").engines
        registered = {s.engine_id for s in states}
        return states, [x for x in ids if x not in registered]

    def wait(self, version: int, phase: str, ids: tuple[str, ...]) -> tuple[str, ...]:
        """Wait until every engine of `ids` still registered reached `phase` for `version`;
        returns those engines (an engine that left is dropped from the wait).

        Fails on silence, not slowness: only when no engine of `ids` reached the phase for
        `timeout_s` seconds in a row (each one that does restarts the clock), so a push to
        many engines on a loaded machine may take longer than `timeout_s` in all. The error
        names the engines still waited for, how many reached the phase (and which), and the
        publisher setting (`ready_timeout_s` / `loaded_timeout_s`).

        Engines outside the group (registered after it formed) may fail this version: they
        join at the next one, so their failure does not end the wait.

        Raises:
            MembersLost: (collective) a member failed and members left within
                `peer_grace_s`: a dead rank broke the group (`_pin_on_lost`).
            PushError: a member failed the version, one was late past `timeout_s`, or (the
                "loaded" wait only) the push was cancelled (`cancelled`, checked at least once
                a second).
        """
        key = "ready_timeout_s" if phase == "ready" else "loaded_timeout_s"
        timeout_s = self.ready_timeout_s if phase == "ready" else self.loaded_timeout_s
        t0 = last = time.monotonic()
        reached: set[str] = set()
        while True:
            if phase == "loaded":  # before the send, engines that acked may be receiving
                self.check_cancelled(version)
            left = last + timeout_s - time.monotonic()
            r = self.client.wait_sync(version, min(max(left, 0.0), 1.0), phase)
            states = {s.engine_id: s for s in r.engines}
            gone = [e for e in ids if e not in states]
            if gone:
                log.warning("push of version %d: engines %s left (%s)", version, gone, phase)
                ids = tuple(e for e in ids if e in states)
                if self.collective and phase == "ready":
                    return ids  # the group cannot form: push() re-plans
            failed = {e: states[e].error for e in ids if _failed(states[e], version)}
            if failed and self.collective:  # a member's death fails the others' receive
                self.pin_on_lost(version, ids, f"while waiting for {phase} ({failed})")
            if failed:
                raise PushError(version, f"engines failed: {failed}", r.engines)
            now_reached = {e for e in ids if _reached(states[e], version, phase)}
            if len(now_reached) == len(ids):  # not r.done: it also ends on a non-member's failure
                return ids
            if now_reached - reached:
                reached |= now_reached
                last = time.monotonic()
                continue
            if time.monotonic() - last >= timeout_s:
                late = [e for e in ids if e not in now_reached]
                raise PushError(
                    version,
                    f"engines {late} not {phase}: {len(now_reached)}/{len(ids)} reached it "
                    f"({sorted(now_reached)}) and none more for {timeout_s:g} s (publisher "
                    f"{key}; {time.monotonic() - t0:.1f} s in all)",
                    r.engines,
                )
            time.sleep(0.05)  # an engine outside the group failed: settle without it


def ids_of(members: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    """The engine ids of (id, TP size) members."""
    return tuple(e for e, _ in members)


def gone_from(members: tuple[tuple[str, int], ...], alive: tuple[str, ...]) -> list[str]:
    """The members whose id is not in `alive`."""
    return [e for e, _ in members if e not in alive]


def _reached(s: m.EngineSyncState, version: int, phase: str) -> bool:
    if s.version < version:
        return False
    return s.phase == "loaded" or (phase == "ready" and s.phase == "ready")


def _failed(s: m.EngineSyncState, version: int) -> bool:
    return s.phase == "failed" and s.version >= version
