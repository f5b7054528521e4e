"""The gRPC servicer: authenticates each call, runs it on `GatewayState`, maps errors.

Each call is checked in this order: the token (UNAUTHENTICATED, PERMISSION_DENIED), the size
of every field (`gateway.bounds`, INVALID_ARGUMENT), then the state method. A `GatewayError`
becomes a gRPC status with its code and message; any other exception becomes INTERNAL with
its type. Every message is cut to `gateway.errors.MAX_MESSAGE_CHARS`; the server keeps
serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from gateway.auth import ENGINE, TRAINER, Authenticator
from gateway.bounds import RequestBounds
from gateway.errors import GatewayError, clip
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
    "Deregister": ((ENGINE,), GatewayState.deregister),
    "SubmitPrompts": ((TRAINER,), GatewayState.submit),
    "FetchRollouts": ((TRAINER,), GatewayState.fetch),
    "PublishVersion": ((TRAINER,), GatewayState.publish),
    "WaitSync": ((TRAINER,), GatewayState.wait_sync),
    "ReportMetrics": ((TRAINER, ENGINE), GatewayState.report_metrics),
    "GetStatus": ((TRAINER, ENGINE), lambda s, r: s.status()),
}


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
            self._auth.check(context.invocation_metadata(), name, roles)
            self._bounds.check(request)
            return fn(self.state, request)
        except GatewayError as e:
            self.state.count_rejected()
            context.abort(grpc.StatusCode[e.code], clip(e.message))
        except Exception as e:  # keep serving; tell the caller what broke
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, clip(f"{name}: {type(e).__name__}: {e}"))

    def Shutdown(self, request, context):  # noqa: N802 (gRPC method name)
        """[trainer] Stop taking work, answer, then stop the server."""
        try:
            self._auth.check(context.invocation_metadata(), "Shutdown", (TRAINER,))
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
