"""Weight versions on the gateway: the engine record, publication, acknowledgements, and the
trainer's wait for a sync. Mixed into `gateway.state.GatewayState`, whose lock (`_cv`),
engines, version and sync parameters these methods use.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Callable

from gateway.errors import invalid
from gateway.events import EventLog
from gateway.validate import check_timeout
from protos import gateway_pb2 as gpb


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


class VersionsMixin:
    """PublishVersion, AckVersion and WaitSync, plus the per-engine sync directive."""

    _cv: threading.Condition
    _engines: dict[str, Engine]
    _version: int
    _publish_seq: int
    events: EventLog
    _sync_params: dict[str, str]
    _engine: Callable[[str, str], Engine]
    _reap_locked: Callable[[], bool]
    _open: Callable[[], None]
    _wait: Callable[..., bool]

    def _directive(self, engine: Engine) -> gpb.SyncDirective:
        if engine.weight_version >= self._version:
            return gpb.SyncDirective()
        return gpb.SyncDirective(
            pending=True, target_version=self._version, params=self._sync_params
        )

    def publish(self, req: gpb.PublishRequest) -> gpb.PublishReply:
        """Make `version` current; every live engine gets a sync directive for it.

        Publishing the current version again with other params is a re-plan: the trainer
        re-sends that version on a new data-plane group (after a member died mid-push, or to
        an engine that registered behind it). Every engine that has not loaded it forgets its
        earlier acknowledgements of it (so a failure of the broken attempt does not count
        against the new one) and its heartbeat long poll answers at once with the new plan.

        Raises:
            GatewayError: INVALID_ARGUMENT for a version below the current one, or the
                current one with the same params (versions only increase).
        """
        with self._cv:
            self._open()
            self._reap_locked()
            params = dict(req.params)
            replan = req.version == self._version
            if req.version < self._version or (
                replan and (req.version == 0 or params == self._sync_params)
            ):
                raise invalid(
                    f"version: expected > {self._version} (versions only increase), "
                    f"got {req.version}"
                )
            self._version = req.version
            self._sync_params = params
            self._publish_seq += 1
            if replan:
                for e in self._engines.values():
                    if e.weight_version < req.version and e.sync_version >= req.version:
                        e.sync_version, e.sync_error = e.weight_version, ""
                        e.sync_phase = gpb.SYNC_PHASE_LOADED
            self.events.emit(
                "published", version=req.version, replan=replan, engines=sorted(self._engines)
            )
            self._cv.notify_all()
            return gpb.PublishReply(engine_ids=sorted(self._engines))

    def ack(self, req: gpb.AckRequest) -> gpb.AckReply:
        """Record an engine's sync progress (READY, LOADED or FAILED) for a published version.

        LOADED makes `version` the engine's weight version and lets it lease. FAILED with
        `serving` keeps it leasing on its previous version; FAILED without it stops its
        leases until a later LOADED. READY changes neither.

        Raises:
            GatewayError: INVALID_ARGUMENT for an unpublished version, a phase other than
                READY/LOADED/FAILED, `serving` set with a phase other than FAILED, or a
                LOADED version below the engine's loaded one; NOT_FOUND for an unknown engine.
        """
        with self._cv:
            self._reap_locked()
            engine = self._engine(req.engine_id, req.engine_key)
            if not 0 <= req.version <= self._version:
                raise invalid(
                    f"version: expected a published version 0..{self._version}, "
                    f"got {req.version} (never published)"
                )
            if req.phase not in (
                gpb.SYNC_PHASE_READY,
                gpb.SYNC_PHASE_LOADED,
                gpb.SYNC_PHASE_FAILED,
            ):
                raise invalid(f"phase: expected READY, LOADED or FAILED, got {req.phase}")
            if req.serving and req.phase != gpb.SYNC_PHASE_FAILED:
                raise invalid(
                    "serving: expected false unless phase is FAILED, got true with phase "
                    f"{gpb.SyncPhase.Name(req.phase)}"
                )
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
                    "loaded", engine=engine.engine_id, version=req.version, current=self._version
                )
            elif req.phase == gpb.SYNC_PHASE_FAILED:
                self.events.emit(
                    "sync_failed",
                    engine=engine.engine_id,
                    version=req.version,
                    serving=req.serving,
                    error=req.error,
                )
            self._cv.notify_all()
            return gpb.AckReply(sync=self._directive(engine))

    def wait_sync(self, req: gpb.WaitSyncRequest) -> gpb.WaitSyncReply:
        """Wait until every live engine reached `phase` for `version`, or one failed it."""
        check_timeout("timeout_s", req.timeout_s)
        if req.phase not in (gpb.SYNC_PHASE_READY, gpb.SYNC_PHASE_LOADED):
            raise invalid(f"phase: expected READY or LOADED, got {req.phase}")
        with self._cv:
            self._reap_locked()
            if not 0 <= req.version <= self._version:
                raise invalid(
                    f"version: expected a published version 0..{self._version}, got {req.version}"
                )

            def reached(e: Engine) -> bool:
                if e.weight_version >= req.version:
                    return True
                return (
                    req.phase == gpb.SYNC_PHASE_READY
                    and e.sync_version >= req.version
                    and e.sync_phase == gpb.SYNC_PHASE_READY
                )

            def settled() -> bool:
                engines = self._engines.values()
                return all(reached(e) for e in engines) or any(
                    e.failed and e.sync_version >= req.version for e in engines
                )

            self._wait(settled, req.timeout_s, "WaitSync")
            states = [
                gpb.EngineSyncState(
                    engine_id=e.engine_id,
                    version=e.sync_version,
                    phase=e.sync_phase,
                    error=e.sync_error,
                    serving=e.serving,
                )
                for e in self._engines.values()
            ]
            done = all(reached(e) for e in self._engines.values())
            return gpb.WaitSyncReply(done=done, engines=states)
