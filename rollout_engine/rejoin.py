"""An engine that loses its gateway registers again: `run_worker` runs `EngineWorker`s over one
started backend, one after another.

A worker ends "dropped" when the gateway no longer knows the engine (it missed heartbeats: a
frozen process, a link down for longer than the gateway's heartbeat timeout) and "lost" when
the gateway stayed unreachable past `WorkerConfig.gateway_retry_s`. Either way, with
`WorkerConfig.rejoin_s` > 0, the next worker registers again over the same backend, with the
version the backend holds, and keeps trying for `rejoin_s` seconds from the loss (each attempt
retries an unreachable gateway for up to `gateway_retry_s`, so the last one may end that much
later); then `run_worker` gives up with `REJOIN_FAILED` and an error line. Before each
attempt it deregisters the lost engine id, should the gateway still know it (an outage
shorter than its heartbeat timeout), so that id's leases go back at once and no push waits
for it.

Registered again, the engine leases nothing until it loaded the gateway's current version
(the gateway holds it back: `must_reach`). Groups in flight at the loss are dropped: the
gateway put their prompts back in the queue when it dropped the engine and refuses any return
under the old id, so no sample is trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

from gateway import messages as m
from gateway.client import GatewayClient
from gateway.errors import GatewayError
from rollout_engine.backend import RolloutBackend
from rollout_engine.calls import GatewayLost
from rollout_engine.config import WorkerConfig
from rollout_engine.worker import DROPPED, LOST, STOPPED, EngineWorker

log = logging.getLogger("rollout_engine")

# `run_worker`'s reason when no registration succeeded within `WorkerConfig.rejoin_s`.
REJOIN_FAILED = "rejoin_failed"


async def run_worker(
    client: GatewayClient, backend: RolloutBackend, spec: m.EngineSpec, cfg: WorkerConfig
) -> str:
    """Run `EngineWorker`s over one started backend until one stops for a reason other than
    "dropped" or "lost", or, after one of those, no registration succeeded within
    `cfg.rejoin_s` seconds (see the module docstring). SIGTERM/SIGINT stop the current worker
    (and any further attempt).

    Returns:
        The last worker's stop reason ("shutdown", "stopped", "error"; "dropped" or "lost"
        with `rejoin_s` = 0), or `REJOIN_FAILED`.

    Raises:
        RegistrationRefused: the gateway refused a registration (reason inside).
        GatewayLost: the first registration got no answer within `gateway_retry_s`.
    """
    loop = asyncio.get_running_loop()
    current: list[EngineWorker] = []
    stopping = asyncio.Event()

    def stop() -> None:
        stopping.set()
        if current:
            current[0].request_stop()

    with contextlib.suppress(RuntimeError, NotImplementedError):  # not the main thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
    lost_at, lost_id, why = 0.0, "", ""
    while True:
        if stopping.is_set():
            return STOPPED
        worker = EngineWorker(client, backend, spec, cfg)
        current[:] = [worker]
        try:
            reason = await worker.run()
        except GatewayLost as e:  # a registration with no answer within gateway_retry_s
            if not lost_id:
                raise
            if stopping.is_set():
                return STOPPED
            if time.monotonic() - lost_at >= cfg.rejoin_s:
                log.error(
                    "gave up rejoining the gateway at %s: engine %s %s and no registration "
                    "succeeded within rejoin_s=%g s; the last attempt: %s",
                    client.address, lost_id, why, cfg.rejoin_s, e,
                )  # fmt: skip
                return REJOIN_FAILED
            await _forget(client, lost_id)
            continue
        if reason not in (DROPPED, LOST) or cfg.rejoin_s == 0:
            return reason
        lost_at, lost_id = time.monotonic(), worker.engine_id
        why = "was dropped by the gateway" if reason == DROPPED else "lost the gateway"
        log.warning(
            "engine %s %s; registering again for up to %g s (rejoin_s)",
            lost_id, why, cfg.rejoin_s,
        )  # fmt: skip
        await _forget(client, lost_id)


async def _forget(client: GatewayClient, engine_id: str) -> None:
    """Deregister `engine_id` if the gateway still knows it (its leases go back at once);
    a gateway that does not know it, or does not answer, changes nothing."""
    with contextlib.suppress(GatewayError):
        back = await asyncio.to_thread(client.deregister, engine_id)
        log.info("deregistered the lost engine %s; %d leased prompts went back", engine_id, back)
