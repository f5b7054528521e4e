"""Weight versions on the gateway: the engine record, publication, acknowledgements, and the
trainer's wait for a sync.

`Versions` is a part of `gateway.state.GatewayState` (held, not mixed in): it owns the current
version, its sync params and the publication counter, and applies PublishVersion, AckVersion
and WaitSync to the engine records it is handed. It takes no lock and never waits: the state
holds its lock around every call and does the waiting.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Iterable

from gateway.errors import invalid
from gateway.events import EventLog
from gateway.validate import check_timeout
from protos import gateway_pb2 as gpb

log = logging.getLogger(__name__)

#: Largest weight version a trainer may publish (2^31 - 1): one version per step never gets
#: near it, and a version near int64's top (2^63 - 1) would leave no room to increase.
MAX_VERSION = (1 << 31) - 1


@dataclasses.dataclass
class Engine:
    """One registered engine as the gateway sees it (clock seconds, versions, counts).

    Two things are kept apart: whether the last sync failed (`failed`: the trainer's
    WaitSync ends with that failure) and whether the engine may lease (`serving`: false
    only while it holds no whole weight version). An engine whose load failed before it
    touched its weights keeps serving `weight_version`, its last loaded one.

    `must_reach` is the gateway's version when the engine registered: it leases only once its
    `weight_version` reached it (a restarted or new engine first receives the current version,
    then leases). `offered_seq` is the publication (a counter bumped by every publish, re-plans
    included) whose directive the engine's heartbeat last carried.
    """

    engine_id: str
    request: gpb.RegisterRequest
    weight_version: int
    last_seen: float
    sync_version: int = 0
    sync_phase: gpb.SyncPhase = gpb.SYNC_PHASE_LOADED
    sync_error: str = ""
    # False from a FAILED ack with serving=False (no whole version held) until a LOADED ack.
    serving: bool = True
    in_calls: int = 0
    active_prompts: int = 0
    groups: int = 0
    completions: int = 0
    tokens: int = 0
    # The secret RegisterReply.engine_key: calls about this engine must carry it.
    key: str = dataclasses.field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    must_reach: int = 0
    offered_seq: int = 0

    @property
    def caught_up(self) -> bool:
        """The engine loaded the version that was current when it registered."""
        return self.weight_version >= self.must_reach

    @property
    def failed(self) -> bool:
        """The engine's last sync acknowledgement was FAILED (whether or not it serves)."""
        return self.sync_phase == gpb.SYNC_PHASE_FAILED


class Versions:
    """The current weight version (0 before the first publish), its sync params (str -> str,
    the trainer's data-plane plan) and `seq`, a counter bumped by every publish, re-plans
    included. Not thread-safe: the caller holds the gateway's lock."""

    def __init__(self, events: EventLog) -> None:
        self.events = events
        self.current = 0
        self.params: dict[str, str] = {}
        self.seq = 0

    def directive(self, engine: Engine) -> gpb.SyncDirective:
        """The sync directive for `engine`: empty once it loaded the current version."""
        if engine.weight_version >= self.current:
            return gpb.SyncDirective()
        return gpb.SyncDirective(
            pending=True, target_version=self.current, params=self.params, seq=self.seq
        )

    def check_published(self, version: int) -> None:
        """Raises GatewayError INVALID_ARGUMENT unless `version` is 0..current."""
        if not 0 <= version <= self.current:
            raise invalid(
                f"version: expected a published version 0..{self.current}, "
                f"got {version} (never published)"
            )

    def publish(self, req: gpb.PublishRequest, engines: dict[str, Engine]) -> gpb.PublishReply:
        """Make `version` current; every engine of `engines` gets a sync directive for it.

        Publishing the current version again with other params is a re-plan: the trainer
        re-sends that version on a new data-plane group (after a member died mid-push, or to
        an engine that registered behind it). Every engine that has not loaded it forgets its
        earlier acknowledgements of it (so a failure of the broken attempt does not count
        against the new one) and its heartbeat long poll answers at once with the new plan.

        Raises:
            GatewayError: INVALID_ARGUMENT for a version below the current one, or the
                current one with the same params (versions only increase), or above
                `MAX_VERSION`.
        """
        if req.version > MAX_VERSION:
            raise invalid(
                f"version: expected at most {MAX_VERSION} (the gateway's MAX_VERSION: versions "
                f"only increase, so a larger one would leave no room), got {req.version}"
            )
        params = dict(req.params)
        replan = req.version == self.current
        if req.version < self.current or (replan and (req.version == 0 or params == self.params)):
            raise invalid(
                f"version: expected > {self.current} (versions only increase), got {req.version}"
            )
        self.current = req.version
        self.params = params
        self.seq += 1
        if replan:
            for e in engines.values():
                if e.weight_version < req.version and e.sync_version >= req.version:
                    e.sync_version, e.sync_error = e.weight_version, ""
                    e.sync_phase = gpb.SYNC_PHASE_LOADED
        self.events.emit("published", version=req.version, replan=replan, engines=sorted(engines))
        return gpb.PublishReply(engine_ids=sorted(engines))

    def ack(self, engine: Engine, req: gpb.AckRequest) -> gpb.AckReply:
        """Record an engine's sync progress (READY, LOADED or FAILED) for a published version.

        LOADED makes `version` the engine's weight version and lets it lease. FAILED with
        `serving` keeps it leasing on its previous version; FAILED without it stops its
        leases until a later LOADED. READY changes neither.

        A READY or FAILED ack of an earlier plan of the current version (`req.seq` set and
        below `seq`: the trainer re-planned the version after it was sent) is ignored, with a
        `stale_ack` event and a log line: it says nothing about the current plan. A LOADED
        ack counts whatever plan brought the weights.

        Raises:
            GatewayError: INVALID_ARGUMENT for an unpublished version, a phase other than
                READY/LOADED/FAILED, `serving` set with a phase other than FAILED, or a
                LOADED version below the engine's loaded one.
        """
        self.check_published(req.version)
        if req.phase not in (gpb.SYNC_PHASE_READY, gpb.SYNC_PHASE_LOADED, gpb.SYNC_PHASE_FAILED):
            raise invalid(f"phase: expected READY, LOADED or FAILED, got {req.phase}")
        if req.serving and req.phase != gpb.SYNC_PHASE_FAILED:
            raise invalid(
                "serving: expected false unless phase is FAILED, got true with phase "
                f"{gpb.SyncPhase.Name(req.phase)}"
            )
        if self.stale(req):
            phase = gpb.SyncPhase.Name(req.phase).removeprefix("SYNC_PHASE_")
            log.warning(
                "ignored the %s ack of %s for version %d: it answers plan %d of that version, "
                "the current plan is %d",
                phase, engine.engine_id, req.version, req.seq, self.seq,
            )  # fmt: skip
            self.events.emit(
                "stale_ack", engine=engine.engine_id, version=req.version, phase=phase,
                seq=req.seq, current_seq=self.seq,
            )  # fmt: skip
            return gpb.AckReply(sync=self.directive(engine))
        if req.phase == gpb.SYNC_PHASE_LOADED:
            if req.version < engine.weight_version:
                raise invalid(
                    f"version: expected >= {engine.weight_version} (the engine's "
                    f"loaded version), got {req.version}"
                )
            engine.weight_version = req.version
            engine.serving = True
        elif req.phase == gpb.SYNC_PHASE_FAILED:
            engine.serving = req.serving
        engine.sync_version, engine.sync_phase = req.version, req.phase
        engine.sync_error = req.error if req.phase == gpb.SYNC_PHASE_FAILED else ""
        if req.phase == gpb.SYNC_PHASE_LOADED:
            self.events.emit(
                "loaded", engine=engine.engine_id, version=req.version, current=self.current
            )
        elif req.phase == gpb.SYNC_PHASE_FAILED:
            self.events.emit(
                "sync_failed",
                engine=engine.engine_id,
                version=req.version,
                serving=req.serving,
                error=req.error,
            )
        return gpb.AckReply(sync=self.directive(engine))

    def stale(self, req: gpb.AckRequest) -> bool:
        """`req` is a READY or FAILED ack of an earlier plan of the current version."""
        return (
            req.phase != gpb.SYNC_PHASE_LOADED
            and req.version == self.current
            and 0 < req.seq < self.seq
        )


def check_wait(req: gpb.WaitSyncRequest) -> None:
    """Raises GatewayError INVALID_ARGUMENT for a bad timeout or a phase not READY/LOADED."""
    check_timeout("timeout_s", req.timeout_s)
    if req.phase not in (gpb.SYNC_PHASE_READY, gpb.SYNC_PHASE_LOADED):
        raise invalid(f"phase: expected READY or LOADED, got {req.phase}")


def reached(e: Engine, req: gpb.WaitSyncRequest) -> bool:
    """`e` loaded `req.version` (or, waiting for READY, acknowledged it READY)."""
    if e.weight_version >= req.version:
        return True
    return (
        req.phase == gpb.SYNC_PHASE_READY
        and e.sync_version >= req.version
        and e.sync_phase == gpb.SYNC_PHASE_READY
    )


def settled(engines: Iterable[Engine], req: gpb.WaitSyncRequest) -> bool:
    """WaitSync may answer: every engine reached `req`, or one failed `req.version`."""
    engines = list(engines)
    return all(reached(e, req) for e in engines) or any(
        e.failed and e.sync_version >= req.version for e in engines
    )


def wait_reply(engines: Iterable[Engine], req: gpb.WaitSyncRequest) -> gpb.WaitSyncReply:
    """The WaitSync answer: each engine's sync state, and `done` when all reached `req`."""
    engines = list(engines)
    states = [
        gpb.EngineSyncState(
            engine_id=e.engine_id,
            version=e.sync_version,
            phase=e.sync_phase,
            error=e.sync_error,
            serving=e.serving,
        )
        for e in engines
    ]
    return gpb.WaitSyncReply(done=all(reached(e, req) for e in engines), engines=states)
