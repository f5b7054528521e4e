"""An engine the gateway dropped registers again over the same backend (`run_worker`): with
the version the backend holds, under a new engine id; with no rejoins left it stops as
"dropped"."""

import asyncio
import importlib.util
import threading
import time
from pathlib import Path

from gateway import messages as m
from rollout_engine.cli import run_worker
from rollout_engine.config import WorkerConfig

_path = Path(__file__).parent / "worker_harness.py"
_spec = importlib.util.spec_from_file_location("worker_harness", _path)
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)

SPEC = m.EngineSpec(backend="jax", model_family="llama", dtype="float32", transports=("gloo",))


def _registered(state, n, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while len(state.events.events("registered")) < n:
        assert time.monotonic() < deadline, f"fewer than {n} registrations"
        time.sleep(0.02)
    return [e["engine"] for e in state.events.events("registered")]


def _drop(server, engine_id, reason):
    """Drop `engine_id` as its broken connection would (the call carries its own key)."""
    key = server.state._engines[engine_id].key
    return server.state.peer_lost(engine_id, key, reason)


def _start(engine, backend, max_rejoins):
    out = {}

    def go():
        cfg = WorkerConfig(lease_wait_s=0.2)
        out["reason"] = asyncio.run(run_worker(engine, backend, SPEC, cfg, max_rejoins))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out


def test_a_dropped_engine_registers_again_with_its_version():
    server, trainer, engine = h.start_gateway(heartbeat_timeout_s=60.0)
    try:
        backend = h.FakeBackend()
        backend._version = 0
        thread, out = _start(engine, backend, max_rejoins=1)
        (first,) = _registered(server.state, 1)
        assert _drop(server, first, "dropped by the test") is True
        ids = _registered(server.state, 2)
        assert ids[0] == first and ids[1] != first
        assert server.state.events.events("registered")[1]["weight_version"] == 0
        assert [e.engine_id for e in trainer.status().engines] == [ids[1]]
        assert _drop(server, ids[1], "dropped again") is True  # no rejoin left
        thread.join(20)
        assert not thread.is_alive() and out["reason"] == "dropped"
        assert len(server.state.events.events("registered")) == 2
    finally:
        trainer.close()
        engine.close()
        server.stop(0)
