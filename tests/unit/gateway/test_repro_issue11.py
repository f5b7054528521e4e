"""The two knock-outs issue 11 reports, on a real server on loopback: 10 MB metric source
names that broke GetStatus, and 64 long-poll fetches that starved a healthy engine."""

import threading

import pytest

from gateway import messages as m
from gateway.config import GatewayConfig, RunSettings
from gateway.errors import GatewayError
from gateway.heartbeat import HeartbeatThread

from .conftest import start_server

SPEC = m.EngineSpec(backend="jax", model_family="llama", dtype="bf16", transports=("gloo",))


def test_seven_10mb_metric_sources_are_refused_and_status_answers():
    run = start_server(GatewayConfig(settings=RunSettings(model_family="llama")))
    try:
        for i in range(7):
            with pytest.raises(GatewayError) as err:
                run.trainer.report_metrics(f"{i}" + "x" * 10_000_000, 1, {"loss": 1.0})
            assert err.value.code == "INVALID_ARGUMENT"
            assert len(err.value.message.encode()) < 1024
        assert len(run.trainer.status().metrics) == 0
    finally:
        run.server.stop(0)


def test_64_long_poll_fetches_do_not_starve_a_heartbeat():
    run = start_server(
        GatewayConfig(
            settings=RunSettings(model_family="llama"), heartbeat_timeout_s=1.5, max_wait_s=6.0
        )
    )
    try:
        reg = run.engine.register_engine(SPEC)
        beat = HeartbeatThread(run.engine, reg.engine_id, reg.heartbeat_interval_s).start()
        polls = [
            threading.Thread(target=lambda: run.trainer.fetch_rollouts(1, timeout_s=6.0))
            for _ in range(64)
        ]
        for t in polls:
            t.start()
        for t in polls:
            t.join()
        status = run.trainer.status()
        assert status.counters.engines_lost == 0
        assert [e.engine_id for e in status.engines] == [reg.engine_id]
        assert beat.alive and beat.error is None
        beat.stop()
    finally:
        run.server.stop(0)
