"""What an engine checks before it starts its backend (minutes for vLLM on a CPU): that the
gateway answers, that it takes the engine's token, and that the run it is configured for is
one this engine can serve.

`precheck` asks the gateway for its status with the engine's token (any role may read it) and
holds the engine's spec against the run's settings with the gateway's own rule
(`gateway.negotiate.negotiate`), so a wrong token, a dead gateway or a wrong family, dtype,
backend or transport is reported in seconds. A run not configured yet passes: registration,
after the backend started, waits for it (`WorkerConfig.register_wait_s`). A checkpoint the
backend cannot run is refused next, before the backend starts (`ModelUnsupported`, raised by
the backend's own check: `rollout_engine.vllm.limits.check_model`).
"""

from __future__ import annotations

import time

from gateway import convert as cv
from gateway import messages as m
from gateway.client import GatewayClient, RegistrationRefused
from gateway.errors import (
    DEADLINE_EXCEEDED,
    PERMISSION_DENIED,
    UNAUTHENTICATED,
    UNAVAILABLE,
    GatewayError,
)
from gateway.negotiate import negotiate


class ModelUnsupported(ValueError):
    """The backend cannot run this checkpoint (e.g. a head size vLLM's CPU attention lacks,
    `rollout_engine.vllm.limits`): refused before the backend starts and before the engine
    registers; the message names the limit."""


class TokenRefused(GatewayError):
    """The gateway does not take the engine's token (UNAUTHENTICATED or PERMISSION_DENIED)."""


def precheck(client: GatewayClient, spec: m.EngineSpec, wait_s: float, token_file: str = "") -> str:
    """Check the gateway, the token and the run's settings before the backend starts.

    Args:
        client: an engine-role client.
        spec: what the engine will register as.
        wait_s: seconds to keep trying a gateway that does not answer (> 0).
        token_file: where the token came from (named in the error).

    Returns:
        "configured" when the run's settings were checked, "unconfigured" when the trainer
        has not configured the run yet (registration waits for it later).

    Raises:
        GatewayError: UNAVAILABLE, no answer within `wait_s` seconds (the message names the
            address and the `gateway_retry_s` setting); any other refusal unchanged.
        TokenRefused: the gateway refused the token (the message names the token file).
        RegistrationRefused: the engine cannot serve the run (the gateway's reason).
    """
    if wait_s <= 0:
        raise ValueError(f"wait_s: expected > 0 seconds, got {wait_s}")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            status = client.status()
            break
        except GatewayError as e:
            if e.code in (UNAUTHENTICATED, PERMISSION_DENIED):
                where = f" from {token_file}" if token_file else ""
                raise TokenRefused(
                    e.code, f"the gateway at {client.address} refused the engine token{where}: "
                    f"{e.message}"
                ) from None  # fmt: skip
            if e.code not in (UNAVAILABLE, DEADLINE_EXCEEDED):
                raise
            if time.monotonic() >= deadline:
                raise GatewayError(
                    UNAVAILABLE,
                    f"no gateway answered at {client.address} within {wait_s} s "
                    f"(worker gateway_retry_s); the backend was not started: {e.message}",
                ) from None
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    decision = negotiate(status.settings, cv.spec_to_pb(spec))
    if decision.refusal and decision.retry:
        return "unconfigured"
    if decision.refusal:
        raise RegistrationRefused(decision.refusal, False)
    return "configured"
