"""`GatewayCaller`: a busy gateway (RESOURCE_EXHAUSTED from its long-poll caps) is retried like
one that did not answer; a refusal is raised unchanged; NOT_FOUND means the engine was dropped."""

import asyncio

import pytest

from gateway.errors import GatewayError
from rollout_engine.calls import EngineDropped, GatewayCaller, GatewayLost


class _Flaky:
    """Fails with `code` for the first `n` calls, then returns the call count."""

    def __init__(self, code: str, n: int) -> None:
        self.code, self.n, self.calls = code, n, 0

    def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.n:
            raise GatewayError(self.code, f"call {self.calls}: busy")
        return self.calls


def _run(caller: GatewayCaller, fn) -> int:
    try:
        return asyncio.run(caller(fn))
    finally:
        caller.close()


def test_busy_gateway_is_retried_until_it_answers():
    fn = _Flaky("RESOURCE_EXHAUSTED", 2)
    assert _run(GatewayCaller(retry_s=30.0), fn) == 3 and fn.calls == 3


def test_busy_past_the_retry_window_is_a_lost_gateway():
    fn = _Flaky("RESOURCE_EXHAUSTED", 10**6)
    with pytest.raises(GatewayLost, match=r"retry window 0.25 s\): RESOURCE_EXHAUSTED"):
        _run(GatewayCaller(retry_s=0.25), fn)
    assert fn.calls >= 2


def test_refusals_are_not_retried_and_not_found_is_a_drop():
    fn = _Flaky("INVALID_ARGUMENT", 1)
    with pytest.raises(GatewayError, match="INVALID_ARGUMENT: call 1"):
        _run(GatewayCaller(retry_s=30.0), fn)
    assert fn.calls == 1
    with pytest.raises(EngineDropped):
        _run(GatewayCaller(retry_s=30.0), _Flaky("NOT_FOUND", 1))
