"""An engine that loses its gateway registers again over the same backend (`run_worker`): the
gateway dropped it, or a cut link kept the gateway unreachable past the gateway's heartbeat
timeout; it rejoins under a new engine id with the version the backend holds, loads the
current version before any lease, and serves the prompts its old id held. With `rejoin_s`
0 it stops at once; with a link that stays cut it gives up after `rejoin_s` (exit status 3)."""

import asyncio
import importlib.util
import threading
import time
from pathlib import Path

from gateway import messages as m
from gateway.client import GatewayClient
from rollout_engine.cli import exit_status
from rollout_engine.config import WorkerConfig
from rollout_engine.rejoin import REJOIN_FAILED, run_worker
from transport.manifest import Manifest, TensorSpec
from transport.sync_plan import SyncPlan


def _load(name):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


h, link_module = _load("worker_harness"), _load("link")

SPEC = m.EngineSpec(backend="jax", model_family="llama", dtype="float32", transports=("gloo",))


class FileLoads(h.FakeBackend):
    """The fake backend whose data plane is scripted: every version loads."""

    async def connect_transport(self, transport: dict, rank_offset: int, world_size: int) -> None:
        self.connects.append((transport, rank_offset, world_size))

    async def update_weights(self, manifest):
        from rollout_engine.backend import UpdateStats

        self._version = manifest.version
        return UpdateStats(manifest.version, manifest.total_bytes, 0.0, 0.0)


def _plan(engine_id: str, version: int, group: int) -> dict[str, str]:
    manifest = Manifest(version, (TensorSpec("w", (2,), "float32"),), bucket_bytes=1024)
    transport = {"kind": "file", "path": "/nonexistent"}
    return SyncPlan(transport, manifest, {engine_id: 1}, 2, group).to_params()


def _until(predicate, what, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return found


def _registered(state, n):
    return _until(
        lambda: (
            [e["engine"] for e in state.events.events("registered")][:n]
            if len(state.events.events("registered")) >= n
            else None
        ),
        f"{n} registrations",
    )


def _drop(server, engine_id, reason):
    """Drop `engine_id` as its broken connection would (the call carries its own key)."""
    key = server.state._engines[engine_id].key
    return server.state.peer_lost(engine_id, key, reason)


def _start(client, backend, **cfg):
    out = {}

    def go():
        worker_cfg = WorkerConfig(lease_wait_s=0.2, **cfg)
        out["reason"] = asyncio.run(run_worker(client, backend, SPEC, worker_cfg))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out


def test_a_dropped_engine_registers_again_with_its_version():
    server, trainer, engine = h.start_gateway(heartbeat_timeout_s=60.0)
    try:
        backend = h.FakeBackend()
        backend._version = 0
        thread, out = _start(engine, backend, rejoin_s=60.0)
        (first,) = _registered(server.state, 1)
        assert _drop(server, first, "dropped by the test") is True
        ids = _registered(server.state, 2)
        assert ids[0] == first and ids[1] != first
        assert server.state.events.events("registered")[1]["weight_version"] == 0
        assert [e.engine_id for e in trainer.status().engines] == [ids[1]]
        trainer.shutdown()
        thread.join(20)
        assert not thread.is_alive() and out["reason"] == "shutdown"
    finally:
        trainer.close()
        engine.close()
        server.stop(0)


def test_with_rejoin_s_zero_a_dropped_engine_stops():
    server, trainer, engine = h.start_gateway(heartbeat_timeout_s=60.0)
    try:
        thread, out = _start(engine, h.FakeBackend(), rejoin_s=0.0)
        (first,) = _registered(server.state, 1)
        assert _drop(server, first, "dropped by the test") is True
        thread.join(20)
        assert not thread.is_alive() and out["reason"] == "dropped"
        assert len(server.state.events.events("registered")) == 1
    finally:
        trainer.close()
        engine.close()
        server.stop(0)


def test_an_engine_cut_off_past_the_heartbeat_timeout_rejoins_at_the_current_version():
    """The link cut while the engine holds a lease: the gateway drops it (missed heartbeats)
    and puts the prompt back; the engine finds the gateway unreachable past gateway_retry_s
    and keeps registering. Meanwhile the trainer publishes version 1. The link back, the
    engine registers under a new id, receives version 1 (after failing the plan it is no
    member of) before any lease, and returns the prompt once, generated at version 1."""
    server, trainer, _ = h.start_gateway(heartbeat_timeout_s=1.5)
    link = link_module.Link(int(server.address.rsplit(":", 1)[1]))
    client = GatewayClient(link.address, h.TOKENS["engine"], margin_s=2.0)
    backend = FileLoads()
    backend.holds["held"] = threading.Event()
    thread, out = _start(client, backend, gateway_retry_s=0.5, rejoin_s=120.0)
    try:
        (first,) = _registered(server.state, 1)
        held = h.prompt("held", [3, 4], n=6)
        trainer.submit_prompts([held])
        _until(lambda: backend.calls == [("held", 0)], "the held prompt to start")
        link.cut()
        (dropped,) = _until(lambda: server.state.events.events("dropped"), "the drop")
        assert dropped["engine"] == first and "missed heartbeats" in dropped["reason"]
        (requeued,) = server.state.events.events("leases_requeued")
        assert (requeued["engine"], requeued["prompts"]) == (first, 1)
        trainer.publish_version(1, _plan(first, 1, group=1))  # a plan of the old group
        backend.holds["held"].set()
        time.sleep(1.0)  # the engine keeps failing to register while the link is cut
        assert len(server.state.events.events("registered")) == 1
        link.restore()
        second = _registered(server.state, 2)[1]
        registered = server.state.events.events("registered")[1]
        assert (registered["weight_version"], registered["current"]) == (0, 1)
        trainer.publish_version(1, _plan(second, 1, group=2))  # the trainer's re-plan
        assert trainer.wait_sync(1, timeout_s=20) == m.SyncResult(
            True, (m.EngineSyncState(second, 1, "loaded", "", True),)
        )
        (group,) = trainer.fetch_rollouts(max_groups=4, timeout_s=20)
        h.check_group(group, held, (1, 1))
        assert group.engine_id == second
        assert trainer.fetch_rollouts(max_groups=4, timeout_s=0.5) == []  # returned once
        mine = [e["event"] for e in server.state.events.events() if e.get("engine") == second]
        assert mine[0] == "registered" and "leased" in mine
        assert "leased" not in mine[: mine.index("loaded")]
        trainer.shutdown()
        thread.join(20)
        assert not thread.is_alive() and out["reason"] == "shutdown"
    finally:
        link.close()
        trainer.close()
        client.close()
        server.stop(0)


def test_an_engine_that_cannot_rejoin_gives_up_after_rejoin_s(caplog):
    server, trainer, _ = h.start_gateway(heartbeat_timeout_s=60.0)
    link = link_module.Link(int(server.address.rsplit(":", 1)[1]))
    client = GatewayClient(link.address, h.TOKENS["engine"], margin_s=2.0)
    try:
        with caplog.at_level("WARNING", logger="rollout_engine"):
            backend = h.FakeBackend()
            thread, out = _start(client, backend, gateway_retry_s=0.3, rejoin_s=1.0)
            (first,) = _registered(server.state, 1)
            trainer.submit_prompts([h.prompt("p", [3, 4])])
            _until(lambda: backend.calls, "a lease: the worker runs")
            link.cut()
            thread.join(60)
        assert not thread.is_alive() and out["reason"] == REJOIN_FAILED
        assert exit_status(out["reason"]) == 3
        assert len(server.state.events.events("registered")) == 1
        lines = [r.getMessage() for r in caplog.records if r.name == "rollout_engine"]
        assert lines[0] == (
            f"engine {first} lost the gateway; registering again for up to 1 s (rejoin_s)"
        )
        prefix = (
            f"gave up rejoining the gateway at {link.address}: engine {first} lost the "
            "gateway and no registration succeeded within rejoin_s=1 s; the last attempt: "
            "no gateway answer for "
        )
        assert lines[-1].startswith(prefix), lines[-1]
        assert [r.levelname for r in caplog.records if r.getMessage() == lines[-1]] == ["ERROR"]
    finally:
        link.close()
        trainer.close()
        client.close()
        server.stop(0)


def test_exit_status_of_each_stop_reason():
    assert [exit_status(r) for r in ("shutdown", "stopped", REJOIN_FAILED, "lost", "error")] == [
        0, 0, 3, 1, 1,
    ]  # fmt: skip
