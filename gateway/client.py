"""`GatewayClient`: the one typed client of the gateway, for the trainer and for engines.

No other code touches the raw gRPC stubs. Every call has a deadline (the call's own
timeout plus `margin_s`); every failure raises `GatewayError` with the gRPC status code
name and the server's message (see `gateway.errors`). Any call may get INVALID_ARGUMENT for a
field over the gateway's bounds (see gateway/README.md, "Bad input") and RESOURCE_EXHAUSTED
when the gateway has no room for one more call; a call that would wait (lease, fetch, submit,
wait-sync) gets RESOURCE_EXHAUSTED past the gateway's `max_long_polls`. Calls about an engine
carry the engine key its registration returned (kept by the client that registered it, see
`adopt_engine`); without it they get PERMISSION_DENIED.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import grpc

from gateway import convert as cv
from gateway import messages as m
from gateway.auth import METADATA_KEY, ROLES, load_tokens
from gateway.errors import GatewayError
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc


class RegistrationRefused(GatewayError):
    """The gateway refused an engine; `reason` says why, `retry` whether waiting may help."""

    def __init__(self, reason: str, retry: bool) -> None:
        super().__init__("FAILED_PRECONDITION", f"registration refused: {reason}")
        self.reason = reason
        self.retry = retry


class GatewayClient:
    """A connection to one gateway with one token (the trainer's or an engine's).

    Args:
        address: "host:port".
        token: the role's token.
        root_certificates: PEM bytes of the CA (or self-signed certificate) to trust; given,
            the channel uses TLS.
        margin_s: seconds added to each call's own timeout for its deadline (> 0).
        max_message_bytes: largest request or reply.
    """

    def __init__(
        self,
        address: str,
        token: str,
        root_certificates: bytes | None = None,
        margin_s: float = 10.0,
        max_message_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        if margin_s <= 0:
            raise ValueError(f"margin_s: expected > 0 seconds, got {margin_s}")
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if root_certificates is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.secure_channel(address, creds, options=options)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._metadata = ((METADATA_KEY, f"Bearer {token}"),)
        self.address = address
        self.margin_s = margin_s
        self._engine_keys: dict[str, str] = {}

    @classmethod
    def from_token_file(
        cls,
        address: str,
        token_file: str | os.PathLike,
        role: str,
        ca_file: str | os.PathLike | None = None,
        **kwargs,
    ) -> GatewayClient:
        """Connect with `role`'s token from a token file (see `gateway.auth`)."""
        if role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
        certs = Path(ca_file).read_bytes() if ca_file is not None else None
        return cls(address, load_tokens(token_file)[role], root_certificates=certs, **kwargs)

    def adopt_engine(self, engine_id: str, engine_key: str) -> None:
        """Send `engine_key` (a `Registration.engine_key`) with this client's calls about
        `engine_id`; `register_engine` does this for the engines it registers."""
        self._engine_keys[engine_id] = engine_key

    def _key(self, engine_id: str) -> str:
        return self._engine_keys.get(engine_id, "")

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, name: str, request, timeout_s: float = 0.0):
        try:
            return getattr(self._stub, name)(
                request, timeout=timeout_s + self.margin_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise GatewayError(e.code().name, e.details() or "") from None

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the channel connects; raise UNAVAILABLE after `timeout_s` seconds."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise GatewayError(
                "UNAVAILABLE", f"no gateway answered at {self.address} within {timeout_s} s"
            ) from None

    # ----- trainer -----
    def configure(self, settings: m.RunSettings) -> m.RunSettings:
        """[trainer] Set the run's family, dtype, transport, rendezvous address, backends."""
        reply = self._call("Configure", gpb.ConfigureRequest(settings=cv.settings_to_pb(settings)))
        return cv.settings_from_pb(reply.settings)

    def submit_prompts(self, prompts: Sequence[m.Prompt], timeout_s: float = 10.0) -> int:
        """[trainer] Queue prompts (all or none), waiting up to `timeout_s` for room.

        Returns the number accepted. Raises GatewayError: INVALID_ARGUMENT (a bad field),
        ALREADY_EXISTS (an id in flight), RESOURCE_EXHAUSTED (no room in time).
        """
        request = gpb.SubmitRequest(
            prompts=[cv.prompt_to_pb(p) for p in prompts], timeout_s=timeout_s
        )
        return self._call("SubmitPrompts", request, timeout_s).accepted

    def fetch_rollouts(
        self, max_groups: int, timeout_s: float, min_groups: int = 1
    ) -> list[m.RolloutGroup]:
        """[trainer] Take up to `max_groups` finished groups (oldest first), waiting up to
        `timeout_s` for `min_groups`; may return fewer (or none) when the time runs out."""
        request = gpb.FetchRequest(
            max_groups=max_groups, min_groups=min_groups, timeout_s=timeout_s
        )
        return [cv.group_from_pb(g) for g in self._call("FetchRollouts", request, timeout_s).groups]

    def publish_version(self, version: int, params: Mapping[str, str] | None = None) -> list[str]:
        """[trainer] Make `version` (> the current one) current; returns the engines told to
        sync. `params` reach each engine in its sync directive (data-plane details)."""
        request = gpb.PublishRequest(version=version, params=dict(params or {}))
        return list(self._call("PublishVersion", request).engine_ids)

    def wait_sync(self, version: int, timeout_s: float, phase: str = "loaded") -> m.SyncResult:
        """[trainer] Wait until every live engine reached `phase` ("ready" or "loaded") for
        `version`, one engine failed it, or `timeout_s` passed. A failed engine may still
        serve its previous version (`EngineSyncState.serving`)."""
        if phase not in ("ready", "loaded"):
            raise ValueError(f"phase: expected 'ready' or 'loaded', got {phase!r}")
        request = gpb.WaitSyncRequest(
            version=version, phase=cv.PHASE_TO_PB[phase], timeout_s=timeout_s
        )
        reply = self._call("WaitSync", request, timeout_s)
        engines = tuple(
            m.EngineSyncState(e.engine_id, e.version, cv.phase_from_pb(e.phase), e.error, e.serving)
            for e in reply.engines
        )
        return m.SyncResult(reply.done, engines)

    def shutdown(self, reason: str = "") -> None:
        """[trainer] Stop the gateway (it answers, then stops within about a second)."""
        self._call("Shutdown", gpb.ShutdownRequest(reason=reason))

    # ----- engines -----
    def register_engine(self, spec: m.EngineSpec, wait_s: float = 0.0) -> m.Registration:
        """[engine] Register; retry a refusal that may clear (run not configured yet) for up
        to `wait_s` seconds.

        Raises:
            RegistrationRefused: the gateway refused the engine (reason inside).
            GatewayError: INVALID_ARGUMENT for a malformed spec, or a transport failure.
        """
        end = time.monotonic() + wait_s
        while True:
            reply = self._call("RegisterEngine", cv.spec_to_pb(spec))
            if reply.accepted:
                self.adopt_engine(reply.engine_id, reply.engine_key)
                return m.Registration(
                    engine_id=reply.engine_id,
                    settings=cv.settings_from_pb(reply.settings),
                    current_version=reply.current_version,
                    sync=cv.sync_from_pb(reply.sync),
                    heartbeat_interval_s=reply.heartbeat_interval_s,
                    heartbeat_timeout_s=reply.heartbeat_timeout_s,
                    lease_seconds=reply.lease_seconds,
                    engine_key=reply.engine_key,
                )
            if not reply.retry or time.monotonic() >= end:
                raise RegistrationRefused(reply.refusal_reason, reply.retry)
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))

    def heartbeat(
        self, engine_id: str, active_prompts: int = 0, wait_s: float = 0.0, known_target: int = 0
    ) -> m.Heartbeat:
        """[engine] Keep the engine alive; learn about a pending sync or a shutdown.

        With `wait_s` > 0 the call is a long poll: it answers as soon as a sync directive
        targets a version above `known_target` (or the gateway shuts down), or after
        `wait_s` seconds (capped by the gateway at its heartbeat interval).
        """
        request = gpb.HeartbeatRequest(
            engine_id=engine_id,
            active_prompts=active_prompts,
            wait_s=wait_s,
            known_target=known_target,
            engine_key=self._key(engine_id),
        )
        reply = self._call("Heartbeat", request, wait_s)
        return m.Heartbeat(cv.sync_from_pb(reply.sync), reply.current_version, reply.shutting_down)

    def lease_prompts(self, engine_id: str, max_prompts: int, timeout_s: float) -> m.Lease:
        """[engine] Lease up to `max_prompts` prompts, waiting up to `timeout_s` for one.

        The lease expires after `expires_in_s`, or at once when heartbeats stop; return or
        release every prompt before then. An empty lease means none was available (see
        `backpressure`, `sync`, `shutting_down`).
        """
        request = gpb.LeaseRequest(
            engine_id=engine_id,
            max_prompts=max_prompts,
            timeout_s=timeout_s,
            engine_key=self._key(engine_id),
        )
        reply = self._call("LeasePrompts", request, timeout_s)
        return m.Lease(
            lease_id=reply.lease_id,
            prompts=tuple(cv.prompt_from_pb(p) for p in reply.prompts),
            expires_in_s=reply.expires_in_s,
            sync=cv.sync_from_pb(reply.sync),
            shutting_down=reply.shutting_down,
            backpressure=reply.backpressure,
        )

    def return_rollouts(
        self,
        engine_id: str,
        lease_id: str,
        groups: Iterable[m.RolloutGroup],
        released_sample_ids: Iterable[str] = (),
    ) -> m.ReturnResult:
        """[engine] Return finished groups of a lease (any subset, any time before it
        expires) and release prompts the engine will not finish. Groups of an expired lease
        are dropped (counted in the result), never delivered twice."""
        request = gpb.ReturnRequest(
            engine_id=engine_id,
            lease_id=lease_id,
            groups=[cv.group_to_pb(g) for g in groups],
            released_sample_ids=list(released_sample_ids),
            engine_key=self._key(engine_id),
        )
        r = self._call("ReturnRollouts", request)
        return m.ReturnResult(r.accepted, r.dropped, r.dropped_reason, r.released)

    def ack_version(
        self,
        engine_id: str,
        version: int,
        phase: str = "loaded",
        error: str = "",
        serving: bool = False,
        seq: int = 0,
    ) -> m.SyncDirective | None:
        """[engine] Report sync progress: "ready" (at a safe point), "loaded" (serving
        `version`) or "failed" (with `error`).

        After "failed", `serving=True` says the engine still holds its previous version
        whole and keeps serving it: it may go on leasing (for that version). With
        `serving=False` it holds no whole version and may lease nothing until a later
        "loaded". Either way the trainer's `wait_sync` for `version` ends with the failure.

        `seq`: the `SyncDirective.seq` of the plan acknowledged (0: unknown). The gateway
        ignores a "ready" or "failed" of an earlier plan of the current version (the trainer
        re-planned it meanwhile), so a late failure of a dead group's plan never counts
        against the new one.

        Returns:
            The directive still pending, if any.

        Raises:
            ValueError: `phase` is not "ready", "loaded" or "failed", or `serving` is set
                with a phase other than "failed".
            GatewayError: INVALID_ARGUMENT for an unpublished version or a loaded version
                going backwards; NOT_FOUND for an unknown engine.
        """
        if phase not in cv.PHASE_TO_PB:
            raise ValueError(f"phase: expected one of {m.SYNC_PHASES}, got {phase!r}")
        if serving and phase != "failed":
            raise ValueError(f"serving: expected False unless phase is 'failed', got {phase!r}")
        request = gpb.AckRequest(
            engine_id=engine_id,
            version=version,
            phase=cv.PHASE_TO_PB[phase],
            error=error,
            serving=serving,
            engine_key=self._key(engine_id),
            seq=seq,
        )
        return cv.sync_from_pb(self._call("AckVersion", request).sync)

    def deregister(self, engine_id: str) -> int:
        """[engine] Leave; returns how many leased prompts went back to the queue."""
        request = gpb.DeregisterRequest(engine_id=engine_id, engine_key=self._key(engine_id))
        return self._call("Deregister", request).returned_prompts

    def drop_engine(self, engine_id: str) -> int:
        """[trainer] Drop an engine whose process is known to have exited (the launcher's
        supervisor saw it): it needs no engine key; its leased prompts go back to the queue
        at once (returned: how many). Raises GatewayError NOT_FOUND when the gateway dropped
        it already."""
        return self._call("Deregister", gpb.DeregisterRequest(engine_id=engine_id)).returned_prompts

    # ----- both -----
    def report_metrics(self, source: str, step: int, values: Mapping[str, float]) -> None:
        """[any] Record named scalars (the latest per source shows in the status). With an
        engine id this client registered as `source`, the report is also its heartbeat."""
        request = gpb.MetricsRequest(
            source=source, step=step, values=dict(values), engine_key=self._key(source)
        )
        self._call("ReportMetrics", request)

    def status(self) -> gpb.StatusReply:
        """[any] Engines, versions, queue depths, counters and rates (a StatusReply message;
        `gateway.status.format_status` renders it as text)."""
        return self._call("GetStatus", gpb.StatusRequest())
