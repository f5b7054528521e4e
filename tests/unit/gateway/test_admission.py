"""Concurrency bounds on a real server: gRPC admits `max_concurrent_rpcs` calls (one thread
each), long polls wait only up to their cap, and heartbeats past theirs answer at once."""

import threading
import time

import grpc
import pytest

from gateway import messages as m
from gateway.client import GatewayClient
from gateway.config import GatewayConfig, RunSettings
from gateway.errors import RESOURCE_EXHAUSTED, GatewayError
from gateway.heartbeat import HeartbeatThread
from gateway.server import GatewayServer
from gateway.state import GatewayState
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc

from .conftest import TOKENS, FakeClock, start_server

SPEC = m.EngineSpec(backend="jax", model_family="llama", dtype="bf16", transports=("gloo",))


def _until(predicate, what: str, tries: int = 500) -> None:
    for _ in range(tries):
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"{what} did not happen within {tries} checks")


def test_config_caps_derive_from_max_concurrent_rpcs_and_leave_threads_free():
    cfg = GatewayConfig(max_concurrent_rpcs=64)
    assert (cfg.long_poll_limit, cfg.heartbeat_poll_limit) == (32, 16)
    with pytest.raises(ValueError, match="at least 4 below max_concurrent_rpcs"):
        GatewayConfig(max_concurrent_rpcs=20, max_long_polls=10, max_heartbeat_polls=7)


def test_long_polls_past_their_cap_are_refused_and_short_calls_still_answer():
    cfg = GatewayConfig(
        settings=RunSettings(model_family="llama"),
        max_concurrent_rpcs=12,
        max_long_polls=2,
        max_heartbeat_polls=2,
    )
    run = start_server(cfg, clock=FakeClock())
    try:
        stub = gateway_pb2_grpc.GatewayStub(run.trainer._channel)
        polls = [
            stub.FetchRollouts.future(
                gpb.FetchRequest(max_groups=1, min_groups=1, timeout_s=30.0),
                timeout=60,
                metadata=run.trainer._metadata,
            )
            for _ in range(2)
        ]
        _until(lambda: run.state._slots.waiting[False] == 2, "two waiting fetches")
        with pytest.raises(GatewayError) as err:
            run.trainer.fetch_rollouts(1, timeout_s=5.0)
        assert err.value.code == RESOURCE_EXHAUSTED
        assert err.value.message == (
            "FetchRollouts: expected at most max_long_polls=2 calls waiting at once, got one "
            "more; retry later (or raise the gateway's max_long_polls)"
        )
        reg = run.engine.register_engine(SPEC)
        with pytest.raises(GatewayError) as err:
            run.engine.lease_prompts(reg.engine_id, 1, timeout_s=5.0)
        assert err.value.message.startswith("LeasePrompts: expected at most max_long_polls=2")
        # calls that do not wait still answer: a poll with no timeout, a heartbeat, status
        assert run.engine.lease_prompts(reg.engine_id, 1, timeout_s=0.0).prompts == ()
        assert run.trainer.fetch_rollouts(1, timeout_s=0.0) == []
        assert run.engine.heartbeat(reg.engine_id).current_version == 0
        status = run.trainer.status()
        assert status.counters.requests_rejected == 2 and run.state._slots.refused == 2
        run.state.shutdown()  # wakes the two waiting fetches
        assert [len(p.result().groups) for p in polls] == [0, 0]
        assert run.state._slots.waiting == {False: 0, True: 0}
    finally:
        run.server.stop(0)


def test_a_heartbeat_past_its_cap_answers_at_once_and_still_counts():
    cfg = GatewayConfig(
        settings=RunSettings(model_family="llama"),
        heartbeat_timeout_s=30.0,
        max_concurrent_rpcs=12,
        max_long_polls=2,
        max_heartbeat_polls=2,
    )
    run = start_server(cfg, clock=FakeClock())
    try:
        regs = [run.engine.register_engine(SPEC) for _ in range(3)]
        stub = gateway_pb2_grpc.GatewayStub(run.engine._channel)
        waiting = [
            stub.Heartbeat.future(
                gpb.HeartbeatRequest(engine_id=r.engine_id, engine_key=r.engine_key, wait_s=10.0),
                timeout=60,
                metadata=run.engine._metadata,
            )
            for r in regs[:2]
        ]
        _until(lambda: run.state._slots.waiting[True] == 2, "two waiting heartbeats")
        run.clock.t += 20.0
        beat = run.engine.heartbeat(regs[2].engine_id, wait_s=10.0)  # past the cap: no wait
        assert beat.current_version == 0 and run.state._slots.waiting[True] == 2
        assert run.state._engines[regs[2].engine_id].last_seen == run.clock.t
        run.state.shutdown()
        assert [w.result().shutting_down for w in waiting] == [True, True]
    finally:
        run.server.stop(0)


class _BlockingStatus(GatewayState):
    """GetStatus holds its thread until `release` is set (to fill the server on purpose)."""

    def __init__(self, config):
        super().__init__(config)
        self.release = threading.Event()
        self.inside = 0
        self._count = threading.Lock()

    def status(self):
        with self._count:
            self.inside += 1
        self.release.wait(30)
        return super().status()


def test_calls_past_max_concurrent_rpcs_get_resource_exhausted_from_grpc():
    cfg = GatewayConfig(settings=RunSettings(model_family="llama"), max_concurrent_rpcs=16)
    state = _BlockingStatus(cfg)
    srv = GatewayServer(cfg, TOKENS, state=state).start()
    try:
        with GatewayClient(srv.address, TOKENS["trainer"], margin_s=5.0) as client:
            stub = gateway_pb2_grpc.GatewayStub(client._channel)
            held = [
                stub.GetStatus.future(gpb.StatusRequest(), timeout=60, metadata=client._metadata)
                for _ in range(16)
            ]
            _until(lambda: state.inside == 16, "16 calls in progress")
            with pytest.raises(grpc.RpcError) as err:
                stub.GetStatus(gpb.StatusRequest(), timeout=10, metadata=client._metadata)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            state.release.set()
            assert [f.result().current_version for f in held] == [0] * 16
            assert client.status().current_version == 0  # admitted again once they finished
    finally:
        state.release.set()
        srv.stop(0)


class _InstantClient:
    """A client whose heartbeat answers at once with no news (as past the gateway's cap),
    failing with RESOURCE_EXHAUSTED on the calls listed in `busy`."""

    def __init__(self, busy=()):
        self.times: list[float] = []
        self.busy = set(busy)
        self.done = threading.Event()

    def heartbeat(self, engine_id, active_prompts, wait_s, known):
        self.times.append(time.monotonic())
        if len(self.times) == 4:
            self.done.set()
        if len(self.times) in self.busy:
            raise GatewayError(RESOURCE_EXHAUSTED, "busy")
        return m.Heartbeat(None, 0, False)


def test_heartbeat_thread_waits_out_the_interval_after_an_early_answer():
    client = _InstantClient()
    beat = HeartbeatThread(client, "e-1", 0.2).start()  # type: ignore[arg-type]
    assert client.done.wait(10)
    beat.stop()
    gaps = [b - a for a, b in zip(client.times, client.times[1:], strict=False)][:3]
    assert len(gaps) == 3 and min(gaps) >= 0.18, gaps
    assert beat.failures == 0 and beat.beats >= 4


def test_heartbeat_thread_retries_a_busy_gateway_after_a_tenth_of_a_second():
    client = _InstantClient(busy={1, 2})
    beat = HeartbeatThread(client, "e-1", 5.0).start()  # type: ignore[arg-type]
    _until(lambda: len(client.times) >= 3, "three heartbeats")
    beat.stop()
    gaps = [b - a for a, b in zip(client.times, client.times[1:], strict=False)][:2]
    assert beat.failures == 2 and beat.beats == 1
    assert all(0.09 <= g < 5.0 for g in gaps), gaps  # retried well before the 5 s interval
