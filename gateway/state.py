"""The gateway's whole state behind one lock: engines, versions, the work queue, metrics.

`GatewayState` is transport-free (the gRPC servicer in `gateway.servicer` wraps it) and
takes an injectable clock, so tests can expire leases and heartbeats without sleeping.
Blocking calls wait on a condition variable in real time, capped by `max_wait_s`; engine
liveness and lease deadlines use the injected clock. `reap()` expires dead engines and
overdue leases; every call runs it, and the server also runs it on a timer.
"""

from __future__ import annotations

import collections
import copy
import hmac
import logging
import threading
import time
from collections.abc import Callable

from gateway.admission import WaitSlots
from gateway.config import GatewayConfig
from gateway.convert import settings_to_pb
from gateway.errors import (
    FAILED_PRECONDITION,
    NOT_FOUND,
    PERMISSION_DENIED,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    GatewayError,
    invalid,
    shown,
)
from gateway.events import EventLog
from gateway.negotiate import check_register, negotiate
from gateway.status import StatusSnapshot, build_status
from gateway.validate import check_id, check_min_version, check_prompt, check_timeout
from gateway.versions import Engine, Versions, check_wait, settled, wait_reply
from gateway.work_queue import ReturnOutcome, WorkQueue
from protos import gateway_pb2 as gpb

log = logging.getLogger(__name__)

_RATE_WINDOW_S = 60.0
_REMEMBERED_LOST = 100_000  # dropped engine ids kept to explain their late calls


class GatewayState:
    """Thread-safe gateway logic; each public method is one RPC (see protos/gateway.proto).

    It holds its parts: `versions` (the published weight version, `gateway.versions`) and
    `queue` (prompts, leases and finished groups, `gateway.work_queue`); the engines, run
    settings, metrics and rates are its own. Every call takes the one lock.
    """

    def __init__(
        self,
        config: GatewayConfig,
        clock: Callable[[], float] = time.monotonic,
        events: EventLog | None = None,
    ):
        self.config = config
        self._clock = clock
        self.events = events or EventLog()
        self._cv = threading.Condition()
        self.versions = Versions(self.events)
        self.queue = WorkQueue(
            config.max_pending_prompts, config.rollout_capacity, config.max_prompt_releases
        )
        self._engines: dict[str, Engine] = {}
        self._lost: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._next_engine = 0
        self._settings = settings_to_pb(config.settings)
        # source -> (step, clock s, values); oldest report first, at most max_metric_sources
        self._metrics: collections.OrderedDict[str, tuple[int, float, dict[str, float]]] = (
            collections.OrderedDict()
        )
        self._slots = WaitSlots(config.long_poll_limit, config.heartbeat_poll_limit)
        self._rates: collections.deque[tuple[float, int, int]] = collections.deque()
        self._started = clock()
        self.shutting_down = False

    # ----- helpers (lock held) -----
    def _wait(
        self,
        ready: Callable[[], bool],
        timeout_s: float,
        what: str = "a long poll",
        heartbeat: bool = False,
    ) -> bool:
        """Wait until `ready()` or shutdown or the (capped) timeout; returns `ready()`.

        A call that must wait takes a slot (`gateway.admission`): past the cap a heartbeat
        answers at once, any other call `what` is refused with RESOURCE_EXHAUSTED.
        """
        if ready() or self.shutting_down or timeout_s <= 0:
            return ready()
        if not self._slots.take(heartbeat, what):
            return ready()
        try:
            end = time.monotonic() + min(timeout_s, self.config.max_wait_s)
            while not ready() and not self.shutting_down:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
                self._reap_locked()
        finally:
            self._slots.give(heartbeat)
        return ready()

    def _engine(self, engine_id: str, key: str) -> Engine:
        """The engine `engine_id`, marked alive now: only a call carrying its `key` (the
        RegisterReply.engine_key) gets here, so no other caller keeps it alive."""
        engine = self._engines.get(engine_id)
        if engine is None:
            why = (
                "it missed heartbeats or left; register again"
                if engine_id in self._lost
                else "never registered"
            )
            raise GatewayError(
                NOT_FOUND,
                f"engine id {shown(engine_id)}: expected a registered "
                f"engine, got an unknown one ({why})",
            )
        if not hmac.compare_digest(key.encode(), engine.key.encode()):
            raise GatewayError(
                PERMISSION_DENIED,
                f"engine id {shown(engine_id)}: expected the engine_key its registration "
                f"returned, got {'none' if not key else 'another key'}",
            )
        engine.last_seen = self._clock()
        return engine

    def _reap_locked(self) -> bool:
        now = self._clock()
        changed = False
        for engine in list(self._engines.values()):
            if engine.in_calls == 0 and now - engine.last_seen > self.config.heartbeat_timeout_s:
                self._drop_engine(
                    engine,
                    f"engine {engine.engine_id!r} missed heartbeats "
                    f"for {self.config.heartbeat_timeout_s} s; its lease expired",
                )
                self.queue.counters["engines_lost"] += 1
                changed = True
        for lease in list(self.queue.leases.values()):
            if now > lease.deadline:
                self.queue.expire(
                    lease,
                    f"lease {lease.lease_id!r} passed its deadline of "
                    f"{self.config.lease_seconds} s and expired",
                )
                changed = True
        if changed:
            self._cv.notify_all()
        return changed

    def _drop_engine(self, engine: Engine, reason: str) -> int:
        """Remove `engine` and send its leased prompts back to the front of the queue at
        once; logs `dropped` then `leases_requeued`. Returns the prompts requeued."""
        n = 0
        leases = [x for x in self.queue.leases.values() if x.engine_id == engine.engine_id]
        for lease in leases:
            n += self.queue.expire(lease, reason)
        del self._engines[engine.engine_id]
        self._lost[engine.engine_id] = None
        while len(self._lost) > _REMEMBERED_LOST:
            self._lost.popitem(last=False)
        log.warning("dropped %s: %s (%d prompts back to the queue)", engine.engine_id, reason, n)
        self.events.emit("dropped", engine=engine.engine_id, reason=reason)
        self.events.emit("leases_requeued", engine=engine.engine_id, leases=len(leases), prompts=n)
        return n

    def _open(self) -> None:
        if self.shutting_down:
            raise GatewayError(UNAVAILABLE, "the gateway is shutting down")

    # ----- public -----
    def count_rejected(self) -> None:
        """Count one refused request (shown in the status counters)."""
        with self._cv:
            self.queue.counters["requests_rejected"] += 1

    def peer_lost(self, engine_id: str, key: str, reason: str) -> bool:
        """Drop `engine_id` now because its connection broke (a long poll of it was cancelled
        by the transport, not answered): its leases go back to the queue at once instead of
        after `heartbeat_timeout_s`. A no-op (False) for an unknown engine, a call that did not
        carry the engine's `key` (no caller can drop another's engine), or while shutting
        down; True when the engine was dropped.
        """
        with self._cv:
            engine = self._engines.get(engine_id)
            if engine is None or self.shutting_down:
                return False
            if not hmac.compare_digest(key.encode(), engine.key.encode()):
                return False
            self._drop_engine(engine, reason)
            self.queue.counters["engines_lost"] += 1
            self._cv.notify_all()
            return True

    def reap(self) -> bool:
        """Expire silent engines and overdue leases now; True if anything expired."""
        with self._cv:
            return self._reap_locked()

    def configure(self, settings: gpb.RunSettings) -> gpb.ConfigureReply:
        """Set the run settings; changing family, mapping, dtype or transport needs no engines."""
        with self._cv:
            self._open()
            self._reap_locked()
            for field in ("model_family", "mapping", "dtype", "transport"):
                old, new = getattr(self._settings, field), getattr(settings, field)
                if self._engines and old and old != new:
                    raise GatewayError(
                        FAILED_PRECONDITION,
                        f"{field}: expected {shown(old)} while {len(self._engines)} engines "
                        f"(e.g. {shown(min(self._engines))}) are registered with it, "
                        f"got {shown(new)}",
                    )
            self._settings.CopyFrom(settings)
            return gpb.ConfigureReply(
                settings=self._settings, current_version=self.versions.current
            )

    def register(self, req: gpb.RegisterRequest) -> gpb.RegisterReply:
        """Register an engine, or refuse it with a reason (see `gateway.negotiate`)."""
        with self._cv:
            self._open()
            self._reap_locked()
            check_register(req, self.versions.current)
            decision = negotiate(self._settings, req)
            cfg = self.config
            reply = gpb.RegisterReply(
                current_version=self.versions.current,
                heartbeat_interval_s=cfg.heartbeat_every_s,
                heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                lease_seconds=cfg.lease_seconds,
            )
            if decision.refusal:
                reply.refusal_reason, reply.retry = decision.refusal, decision.retry
                return reply
            if len(self._engines) >= cfg.max_engines:
                raise GatewayError(
                    RESOURCE_EXHAUSTED,
                    f"engines: expected at most max_engines={cfg.max_engines} registered at "
                    "once, got one more",
                )
            self._next_engine += 1
            # a name's first 64 characters: the id stays within max_name_chars
            engine_id = f"{(req.name or req.backend)[:64]}-{self._next_engine}"
            engine = Engine(engine_id, req, req.weight_version, self._clock())
            # An engine that joins behind the current version leases only once it loaded it.
            engine.must_reach = self.versions.current
            engine.offered_seq = self.versions.seq
            self._engines[engine_id] = engine
            self.events.emit(
                "registered",
                engine=engine_id,
                weight_version=req.weight_version,
                current=self.versions.current,
            )
            reply.accepted, reply.engine_id, reply.engine_key = True, engine_id, engine.key
            reply.settings.CopyFrom(decision.settings)
            reply.sync.CopyFrom(self.versions.directive(engine))
            return reply

    def heartbeat(self, req: gpb.HeartbeatRequest) -> gpb.HeartbeatReply:
        """Mark the engine alive; answer with its sync directive, waiting up to wait_s
        (capped at the heartbeat interval) for one that targets a version > known_target."""
        check_timeout("wait_s", req.wait_s)
        with self._cv:
            self._reap_locked()
            engine = self._engine(req.engine_id, req.engine_key)
            engine.active_prompts = max(0, req.active_prompts)
            engine.in_calls += 1

            def news() -> bool:
                d = self.versions.directive(engine)
                replanned = d.pending and engine.offered_seq < self.versions.seq
                return d.target_version > req.known_target or replanned

            try:
                self._wait(news, min(req.wait_s, self.config.heartbeat_every_s), heartbeat=True)
            finally:
                engine.in_calls -= 1
                engine.last_seen = self._clock()
            if self.versions.directive(engine).pending:
                engine.offered_seq = self.versions.seq
            return gpb.HeartbeatReply(
                sync=self.versions.directive(engine),
                current_version=self.versions.current,
                shutting_down=self.shutting_down,
            )

    def lease(self, req: gpb.LeaseRequest) -> gpb.LeaseReply:
        """Lease up to max_prompts prompts, waiting up to timeout_s for at least one.

        An engine whose last sync failed but that still serves its previous version leases
        as usual, for that version (`Engine.serving`). An engine that registered behind the
        gateway's version gets nothing (the call waits, then answers empty) until it loaded
        the version that was current when it registered (`Engine.must_reach`).

        Raises:
            GatewayError: INVALID_ARGUMENT for max_prompts < 1 or a bad timeout; NOT_FOUND
                for an unknown engine; PERMISSION_DENIED without its engine key;
                FAILED_PRECONDITION while the engine holds no whole weight version (a FAILED
                ack without `serving`, no LOADED since); RESOURCE_EXHAUSTED when it would
                wait past `max_long_polls`.
        """
        if req.max_prompts < 1:
            raise invalid(f"max_prompts: expected >= 1, got {req.max_prompts}")
        check_timeout("timeout_s", req.timeout_s)
        with self._cv:
            self._reap_locked()
            engine = self._engine(req.engine_id, req.engine_key)
            if not engine.serving:
                why = (
                    f"failed to load version {engine.sync_version} ({engine.sync_error})"
                    if engine.failed
                    else f"is syncing to version {engine.sync_version} after a failed load"
                )
                raise GatewayError(
                    FAILED_PRECONDITION,
                    f"engine {engine.engine_id!r} {why} and holds no whole weight version; "
                    "expected a LOADED acknowledgement before leasing",
                )
            engine.in_calls += 1
            try:
                self._wait(
                    lambda: engine.caught_up and all(self.queue.could_lease(engine.weight_version)),
                    req.timeout_s,
                    "LeasePrompts",
                )
            finally:
                engine.in_calls -= 1
                engine.last_seen = self._clock()
            reply = gpb.LeaseReply(
                sync=self.versions.directive(engine), shutting_down=self.shutting_down
            )
            # Re-checked after the wait: a failed ack may have arrived while this call waited.
            gone = engine.engine_id not in self._engines or self.shutting_down
            if gone or not engine.serving or not engine.caught_up:
                return reply
            lease = self.queue.lease(
                engine.engine_id,
                req.max_prompts,
                engine.weight_version,
                self._clock(),
                self.config.lease_seconds,
                self.config.max_message_bytes // 2,
            )
            if lease is None:
                eligible, room = self.queue.could_lease(engine.weight_version)
                reply.backpressure = eligible and not room
                return reply
            reply.lease_id = lease.lease_id
            reply.prompts.extend(self.queue.prompts_of(lease))
            self.events.emit(
                "leased",
                engine=engine.engine_id,
                lease=lease.lease_id,
                prompts=len(lease.outstanding),
                weight_version=engine.weight_version,
                current=self.versions.current,
            )
            reply.expires_in_s = lease.deadline - self._clock()
            return reply

    def return_rollouts(self, req: gpb.ReturnRequest) -> gpb.ReturnReply:
        """Accept a lease's finished groups and released prompts (late ones are dropped)."""
        check_id("lease_id", req.lease_id)
        with self._cv:
            self._reap_locked()
            engine = self._engine(req.engine_id, req.engine_key)
            out: ReturnOutcome = self.queue.complete(
                engine.engine_id,
                req.lease_id,
                list(req.groups),
                list(req.released_sample_ids),
                self._clock(),
                self.versions.current,
                self.config.max_message_bytes // 2,
            )
            for sid in out.abandoned:
                self.events.emit("prompt_abandoned", sample_id=sid, engine=engine.engine_id,
                                 releases=self.config.max_prompt_releases)  # fmt: skip
            engine.groups += out.accepted
            engine.completions += out.completions
            engine.tokens += out.tokens
            self._note_rate(out.completions, out.tokens)
            self._cv.notify_all()
            return gpb.ReturnReply(
                accepted=out.accepted,
                dropped=out.dropped,
                dropped_reason=out.dropped_reason,
                released=out.released,
            )

    def deregister(
        self, req: gpb.DeregisterRequest, by_trainer: bool = False
    ) -> gpb.DeregisterReply:
        """Remove an engine; its leased prompts go back to the front of the queue. Logs a
        `deregistered` event naming the caller's role (``by``: "trainer" or "engine") before
        `dropped`.

        Args:
            by_trainer: the call came with the trainer's token. Intended: the run's owner
                drops any engine without that engine's key (the launcher's supervisor drops
                one whose process it saw exit, so its leases go back at once); the trainer
                token already controls the whole run (it publishes weights and shuts the
                gateway down). Else the engine leaves and its key must match.

        Raises:
            GatewayError: NOT_FOUND (no such engine: never registered, or already dropped),
                PERMISSION_DENIED (an engine's call with a wrong key).
        """
        with self._cv:
            if by_trainer:
                engine = self._engines.get(req.engine_id)
                if engine is None:
                    raise GatewayError(
                        NOT_FOUND, f"engine id {shown(req.engine_id)}: not registered (dropped?)"
                    )
                reason = f"engine {engine.engine_id!r} deregistered by the trainer (it exited)"
            else:
                engine = self._engine(req.engine_id, req.engine_key)
                reason = f"engine {engine.engine_id!r} deregistered"
            by = "trainer" if by_trainer else "engine"
            self.events.emit("deregistered", engine=engine.engine_id, by=by)
            n = self._drop_engine(engine, reason)
            self._cv.notify_all()
            return gpb.DeregisterReply(returned_prompts=n)

    def submit(self, req: gpb.SubmitRequest) -> gpb.SubmitReply:
        """Queue prompts (all or none), waiting up to timeout_s for room."""
        check_timeout("timeout_s", req.timeout_s)
        cfg = self.config
        for p in req.prompts:
            check_prompt(
                p, cfg.max_group_size, cfg.max_prompt_tokens, cfg.max_new_tokens, cfg.max_turns
            )
        n = len(req.prompts)
        if n > self.queue.max_pending:
            raise invalid(
                f"prompts: expected at most {self.queue.max_pending} per call (the "
                f"pending capacity), got {n}"
            )
        with self._cv:
            self._open()
            self._reap_locked()
            check_min_version(req.prompts, self.versions.current, cfg.min_version_ahead)
            self.queue.check_new(list(req.prompts))

            def room() -> bool:
                return self.queue.pending(True) + self.queue.pending(False) + n <= (
                    self.queue.max_pending
                )

            if not self._wait(room, req.timeout_s, "SubmitPrompts"):
                self._open()
                raise GatewayError(
                    RESOURCE_EXHAUSTED,
                    f"pending queue full: expected room for {n} prompts within "
                    f"{req.timeout_s} s, got {self.queue.max_pending - self._pending()} free",
                )
            self.queue.check_new(list(req.prompts))
            self.queue.submit(list(req.prompts), self._clock())
            self._cv.notify_all()
            return gpb.SubmitReply(
                accepted=n,
                pending_train=self.queue.pending(False),
                pending_eval=self.queue.pending(True),
            )

    def _pending(self) -> int:
        return self.queue.pending(True) + self.queue.pending(False)

    def fetch(self, req: gpb.FetchRequest) -> gpb.FetchReply:
        """Take up to max_groups finished groups, waiting up to timeout_s for min_groups."""
        check_timeout("timeout_s", req.timeout_s)
        if req.max_groups < 1:
            raise invalid(f"max_groups: expected >= 1, got {req.max_groups}")
        if not 0 <= req.min_groups <= req.max_groups:
            raise invalid(
                f"min_groups: expected 0..max_groups={req.max_groups}, got {req.min_groups}"
            )
        with self._cv:
            self._reap_locked()
            need = max(1, req.min_groups)
            self._wait(lambda: self.queue.ready >= need, req.timeout_s, "FetchRollouts")
            groups = self.queue.fetch(req.max_groups, self.config.max_message_bytes // 2)
            self._cv.notify_all()
            return gpb.FetchReply(groups=groups)

    def report_metrics(self, req: gpb.MetricsRequest) -> gpb.MetricsReply:
        """Keep the latest metrics of each source (at most `max_metric_sources`: a new
        source evicts the one reported longest ago). A report from an engine id counts as
        its heartbeat only with its engine_key."""
        check_id("source", req.source)
        with self._cv:
            self._metrics.pop(req.source, None)
            self._metrics[req.source] = (req.step, self._clock(), dict(req.values))
            while len(self._metrics) > self.config.max_metric_sources:
                self._metrics.popitem(last=False)
            engine = self._engines.get(req.source)
            if engine is not None and hmac.compare_digest(
                req.engine_key.encode(), engine.key.encode()
            ):
                engine.last_seen = self._clock()
            return gpb.MetricsReply()

    def shutdown(self) -> None:
        """Refuse new work and wake every waiting call."""
        with self._cv:
            self.shutting_down = True
            self._cv.notify_all()

    def publish(self, req: gpb.PublishRequest) -> gpb.PublishReply:
        """PublishVersion: see `Versions.publish` (refused while shutting down)."""
        with self._cv:
            self._open()
            self._reap_locked()
            reply = self.versions.publish(req, self._engines)
            self._cv.notify_all()
            return reply

    def ack(self, req: gpb.AckRequest) -> gpb.AckReply:
        """AckVersion: see `Versions.ack`; NOT_FOUND/PERMISSION_DENIED as `_engine`."""
        with self._cv:
            self._reap_locked()
            engine = self._engine(req.engine_id, req.engine_key)
            reply = self.versions.ack(engine, req)
            self._cv.notify_all()
            return reply

    def wait_sync(self, req: gpb.WaitSyncRequest) -> gpb.WaitSyncReply:
        """Wait until every live engine reached `phase` for `version`, or one failed it.

        Raises:
            GatewayError: INVALID_ARGUMENT for a bad timeout, a phase other than READY or
                LOADED, or an unpublished version; RESOURCE_EXHAUSTED past `max_long_polls`.
        """
        check_wait(req)
        with self._cv:
            self._reap_locked()
            self.versions.check_published(req.version)
            self._wait(lambda: settled(self._engines.values(), req), req.timeout_s, "WaitSync")
            return wait_reply(self._engines.values(), req)

    def status(self) -> gpb.StatusReply:
        """A snapshot of engines, versions, queue depths, counters and rates."""
        with self._cv:
            self._reap_locked()
            t = time.monotonic()
            self._trim_rates(t)
            snap = self._snapshot(t)
        return build_status(snap)

    def _note_rate(self, completions: int, tokens: int) -> None:
        """Record one return for the rates of the last `_RATE_WINDOW_S` seconds (kept to that
        window on every return, not only when someone asks for the status)."""
        t = time.monotonic()
        self._rates.append((t, completions, tokens))
        self._trim_rates(t)

    def _trim_rates(self, t: float) -> None:
        while self._rates and t - self._rates[0][0] > _RATE_WINDOW_S:
            self._rates.popleft()

    def _snapshot(self, wall: float) -> StatusSnapshot:
        """Copies of what the status reports (lock held)."""
        q = self.queue
        leased: dict[str, int] = {}
        for lease in q.leases.values():
            leased[lease.engine_id] = leased.get(lease.engine_id, 0) + len(lease.outstanding)
        return StatusSnapshot(
            now=self._clock(),
            wall=wall,
            started=self._started,
            version=self.versions.current,
            shutting_down=self.shutting_down,
            settings=copy.deepcopy(self._settings),
            engines=tuple(copy.copy(e) for e in self._engines.values()),
            leased=leased,
            queues=gpb.QueueDepths(
                pending_eval=q.pending(True),
                pending_train=q.pending(False),
                leased_prompts=q.leased_prompts,
                ready_groups=q.ready,
                rollout_capacity=q.rollout_capacity,
            ),
            counters=dict(q.counters),
            rates=tuple(self._rates),
            metrics={k: (st, t, dict(v)) for k, (st, t, v) in self._metrics.items()},
        )
