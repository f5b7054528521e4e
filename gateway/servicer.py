"""The gRPC servicer: authenticates each call, runs it on `GatewayState`, maps errors.

Each call is checked in this order: the token (UNAUTHENTICATED, PERMISSION_DENIED), that its
bytes parsed (`gateway.handlers.Unparsed`, INVALID_ARGUMENT), the size of every field
(`gateway.bounds`, INVALID_ARGUMENT), then the state method. A `GatewayError`
becomes a gRPC status with its code and message; any other exception becomes INTERNAL with
its type. Every message is cut to `gateway.errors.MAX_MESSAGE_CHARS`; the server keeps
serving.

An engine's long polls (Heartbeat, LeasePrompts) watch its connection: when gRPC ends one of
them before the handler answered and not because its deadline passed (the engine died, or its
channel closed), the engine is dropped at once (`GatewayState.peer_lost`, only for a call that
carried that engine's key) and its leases go back to the queue, instead of after the heartbeat
timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc

from gateway.auth import ENGINE, TRAINER, Authenticator
from gateway.bounds import RequestBounds
from gateway.errors import GatewayError, clip, invalid, shown
from gateway.handlers import Unparsed
from gateway.state import GatewayState
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc

log = logging.getLogger(__name__)

# method name -> (roles allowed, state method)
_ROUTES: dict[str, tuple[tuple[str, ...], Callable]] = {
    "Configure": ((TRAINER,), lambda s, r: s.configure(r.settings)),
    "RegisterEngine": ((ENGINE,), GatewayState.register),
    "Heartbeat": ((ENGINE,), GatewayState.heartbeat),
    "LeasePrompts": ((ENGINE,), GatewayState.lease),
    "ReturnRollouts": ((ENGINE,), GatewayState.return_rollouts),
    "AckVersion": ((ENGINE,), GatewayState.ack),
    # an engine leaves (its key); the trainer drops any engine, without its key (intended:
    # the launcher drops one whose process exited; logged as `deregistered` by "trainer")
    "Deregister": ((ENGINE, TRAINER), GatewayState.deregister),
    "SubmitPrompts": ((TRAINER,), GatewayState.submit),
    "FetchRollouts": ((TRAINER,), GatewayState.fetch),
    "PublishVersion": ((TRAINER,), GatewayState.publish),
    "WaitSync": ((TRAINER,), GatewayState.wait_sync),
    "ReportMetrics": ((TRAINER, ENGINE), GatewayState.report_metrics),
    "GetStatus": ((TRAINER, ENGINE), lambda s, r: s.status()),
}


# The engine's long polls whose early end means its connection broke.
_WATCHED = ("Heartbeat", "LeasePrompts")
# A call ended with less than this many seconds left before its deadline ran out, not broke.
_DEADLINE_SLACK_S = 0.5


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Serves every RPC of protos/gateway.proto over one `GatewayState`.

    Args:
        state: the gateway state.
        auth: the token checker.
        on_shutdown: called (once, after the reply is built) when the trainer asks to stop.
    """

    def __init__(
        self, state: GatewayState, auth: Authenticator, on_shutdown: Callable[[str], None]
    ) -> None:
        self.state = state
        self._auth = auth
        self._bounds = RequestBounds(state.config)
        self._on_shutdown = on_shutdown

    def _run(self, name: str, request, context: grpc.ServicerContext):
        roles, fn = _ROUTES[name]
        try:
            role = self._auth.check(context.invocation_metadata(), name, roles)
            if isinstance(request, Unparsed):
                raise invalid(request.message)
            self._bounds.check(request)
            if name == "Deregister":
                return self.state.deregister(request, by_trainer=role == TRAINER)
            if name not in _WATCHED:
                return fn(self.state, request)
            answered = threading.Event()
            context.add_callback(lambda: self._ended(name, request, context, answered))
            try:
                return fn(self.state, request)
            finally:
                answered.set()
        except GatewayError as e:
            self.state.count_rejected()
            context.abort(grpc.StatusCode[e.code], clip(e.message))
        except Exception as e:  # keep serving; tell the caller what broke
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, clip(f"{name}: {type(e).__name__}: {e}"))

    def _ended(
        self, name: str, request: Any, context: grpc.ServicerContext, answered: threading.Event
    ) -> None:
        """gRPC's end-of-call callback of a watched long poll (see the module docstring)."""
        if answered.is_set():
            return
        left = context.time_remaining()
        if left is not None and left < _DEADLINE_SLACK_S:
            return  # its deadline passed: a slow answer, not a dead peer
        engine_id = shown(request.engine_id)
        self.state.peer_lost(
            request.engine_id,
            request.engine_key,
            f"engine {engine_id}: its {name} long poll was cancelled before the answer "
            "(its connection dropped: the process died or closed its channel)",
        )

    def Shutdown(self, request, context):  # noqa: N802 (gRPC method name)
        """[trainer] Stop taking work, answer, then stop the server."""
        try:
            self._auth.check(context.invocation_metadata(), "Shutdown", (TRAINER,))
            if isinstance(request, Unparsed):
                raise invalid(request.message)
            self._bounds.check(request)
        except GatewayError as e:
            self.state.count_rejected()
            context.abort(grpc.StatusCode[e.code], clip(e.message))
        self.state.shutdown()
        self._on_shutdown(request.reason or "asked by the trainer")
        return gpb.ShutdownReply()


def _bind(name: str):
    def method(self, request, context):
        return self._run(name, request, context)

    method.__name__ = name
    method.__doc__ = f"Route {name} to GatewayState (see protos/gateway.proto)."
    return method


for _name in _ROUTES:
    setattr(GatewayServicer, _name, _bind(_name))
