"""Start, run and stop a gateway server: gRPC on host:port, optional TLS, a reaper thread."""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from pathlib import Path

import grpc

from gateway.auth import Authenticator
from gateway.config import GatewayConfig
from gateway.events import EventLog
from gateway.handlers import add_to_server
from gateway.servicer import GatewayServicer
from gateway.state import GatewayState

log = logging.getLogger(__name__)


class GatewayServer:
    """One gateway: its state, a gRPC server and a timer that expires leases and engines.

    Args:
        config: server settings.
        tokens: {"trainer": token, "engine": token} (see `gateway.auth.load_tokens`).
        host: interface to listen on (127.0.0.1 unless told otherwise).
        port: TCP port; 0 picks a free one (see `port` after `start`).
        cert_file, key_file: PEM certificate chain and private key; both or neither. With
            them the server speaks TLS only.
        state: an existing state (tests inject one with a fake clock).
        events_file: JSONL file the event log (`gateway.events`) is appended to; None keeps
            events in memory only (ignored when `state` is given).

    The server runs `config.max_concurrent_rpcs` threads and gRPC admits at most as many
    calls at once (more get RESOURCE_EXHAUSTED), so an admitted call never queues for a
    thread; `gateway.admission` keeps the waiting calls to their caps within that.
    """

    def __init__(
        self,
        config: GatewayConfig,
        tokens: dict[str, str],
        host: str = "127.0.0.1",
        port: int = 0,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
        state: GatewayState | None = None,
        events_file: str | Path | None = None,
    ) -> None:
        if (cert_file is None) != (key_file is None):
            raise ValueError(
                f"TLS: expected both a certificate and a key or neither, got cert={cert_file} "
                f"key={key_file}"
            )
        self.config = config
        self.state = state or GatewayState(config, events=EventLog(events_file))
        self._stopped = threading.Event()
        workers = config.max_concurrent_rpcs
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gateway"),
            maximum_concurrent_rpcs=workers,
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        servicer = GatewayServicer(self.state, Authenticator(tokens), self._stop_soon)
        add_to_server(servicer, self._server)  # unparsable requests: INVALID_ARGUMENT
        target = f"{host}:{port}"
        if cert_file is not None and key_file is not None:
            creds = grpc.ssl_server_credentials(
                [(Path(key_file).read_bytes(), Path(cert_file).read_bytes())]
            )
            self.port = self._server.add_secure_port(target, creds)
        else:
            self.port = self._server.add_insecure_port(target)
        if self.port == 0:
            raise OSError(f"could not listen on {target}: expected a free port, got none")
        self.host = host
        self.tls = cert_file is not None
        self._reaper = threading.Thread(target=self._reap_loop, name="gateway-reaper", daemon=True)

    @property
    def address(self) -> str:
        """`host:port` for clients."""
        return f"{self.host}:{self.port}"

    def start(self) -> GatewayServer:
        """Start serving; returns self."""
        self._server.start()
        self._reaper.start()
        log.info("gateway listening on %s (tls=%s)", self.address, self.tls)
        return self

    def _reap_loop(self) -> None:
        tick = min(0.5, self.config.heartbeat_timeout_s / 4, self.config.lease_seconds / 4)
        while not self._stopped.wait(tick):
            self.state.reap()

    def _stop_soon(self, reason: str) -> None:
        log.info("gateway shutting down: %s", reason)
        threading.Thread(target=self.stop, name="gateway-stop", daemon=True).start()

    def stop(self, grace_s: float = 1.0) -> None:
        """Refuse new work, wake waiting calls, and stop within `grace_s` seconds."""
        self.state.shutdown()
        self._stopped.set()
        self._server.stop(grace_s).wait()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server stopped (True) or `timeout_s` passed (False)."""
        return not self._server.wait_for_termination(timeout_s)
