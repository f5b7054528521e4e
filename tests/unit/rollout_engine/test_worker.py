"""The engine worker loop against the real gateway on loopback, with a small backend beside it
whose outputs are known exactly: lease, generate concurrently, return with version stamps,
refuse what it cannot serve, keep serving its version after an update that failed before
touching it (and stop serving after one that broke it), and stop cleanly (stop request,
gateway shutdown, lost gateway)."""

import importlib.util
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gateway import messages as m
from gateway.client import GatewayClient
from rollout_engine.backend import UpdateStats
from transport.manifest import Manifest, ManifestError, TensorSpec
from transport.sync_plan import SyncPlan

_spec = importlib.util.spec_from_file_location(
    "worker_harness", Path(__file__).with_name("worker_harness.py")
)
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)


@pytest.fixture
def gateway():
    server, trainer, engine = h.start_gateway()
    yield server, trainer, engine
    trainer.close()
    engine.close()
    server.stop(0)


class ScriptedUpdates(h.FakeBackend):
    """The fake backend with a scripted data plane: `outcomes[version]` is "refuse" (a
    ManifestError before anything loads: the held version stays whole), "break" (a failure
    after part of the version loaded: no whole version held) or "load" (the version loads)."""

    def __init__(self, outcomes: dict[int, str]) -> None:
        super().__init__()
        self.outcomes = outcomes

    async def connect_transport(self, transport: dict, rank_offset: int, world_size: int) -> None:
        self.connects.append((transport, rank_offset, world_size))

    async def update_weights(self, manifest: Manifest) -> UpdateStats:
        v, outcome = manifest.version, self.outcomes[manifest.version]
        if outcome == "refuse":
            raise ManifestError(f"version {v} refused by the fake")
        if outcome == "break":
            self._version = None
            raise RuntimeError(f"version {v} broke after a partial load")
        self._version = v
        return UpdateStats(v, manifest.total_bytes, 0.0, 0.0)


def _plan(engine_id: str, version: int) -> dict[str, str]:
    """Directive params naming `engine_id` rank 1 of a 2-rank group, one float32 [2] tensor."""
    manifest = Manifest(version, (TensorSpec("w", (2,), "float32"),), bucket_bytes=1024)
    transport = {"kind": "file", "path": "/nonexistent"}
    return SyncPlan(transport, manifest, {engine_id: 1}, world_size=2).to_params()


def _wait_for(predicate, what: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_update_refused_before_loading_keeps_serving_the_old_version(gateway):
    server, trainer, engine = gateway
    backend = ScriptedUpdates({1: "refuse", 2: "load"})
    backend.holds["held"] = threading.Event()
    run = h.WorkerThread(engine, backend, lease_wait_s=0.2)
    engine_id = run.wait_registered()
    held = h.prompt("held", [3, 4], n=6)
    trainer.submit_prompts([held])
    _wait_for(lambda: backend.calls == [("held", 0)], "the held prompt to start")

    trainer.publish_version(1, _plan(engine_id, 1))
    result = trainer.wait_sync(1, timeout_s=10)
    error = "ManifestError: version 1 refused by the fake"
    assert result == m.SyncResult(False, (m.EngineSyncState(engine_id, 1, "failed", error, True),))
    assert run.worker.stats.failed_updates == [(1, error)]
    _wait_for(lambda: run.worker.leasing, "leasing to resume")  # the sync loop ends after the ack
    assert backend.weight_version == 0
    (status,) = trainer.status().engines
    assert (status.weight_version, status.sync_version, status.sync_error, status.serving) == (
        0,
        1,
        error,
        True,
    )

    # it keeps leasing for version 0; the group in flight across the failure finishes too
    after = h.prompt("after", [7, 8], g=3)
    trainer.submit_prompts([after])
    (group,) = trainer.fetch_rollouts(max_groups=1, timeout_s=10)
    h.check_group(group, after, (0, 0))
    assert group.engine_id == engine_id
    backend.holds["held"].set()
    (group,) = trainer.fetch_rollouts(max_groups=1, timeout_s=10)
    h.check_group(group, held, (0, 0))
    assert all(c.version_spans == ((0, 0, len(c.token_ids)),) for c in group.completions)

    # the next version is attempted (and loads); version 1 is not tried again
    trainer.publish_version(2, _plan(engine_id, 2))
    assert trainer.wait_sync(2, timeout_s=10) == m.SyncResult(
        True, (m.EngineSyncState(engine_id, 2, "loaded", "", True),)
    )
    assert [u.version for u in run.worker.stats.updates] == [2]
    assert run.worker.stats.failed_updates == [(1, error)]
    fresh = h.prompt("fresh", [9])
    trainer.submit_prompts([fresh])
    (group,) = trainer.fetch_rollouts(max_groups=1, timeout_s=10)
    h.check_group(group, fresh, (2, 2))
    trainer.shutdown()
    assert run.join() == "shutdown"
    assert run.worker.stats.groups_returned == 3
    assert run.worker.stats.prompts_released == 0


class HeldFailedAcks(GatewayClient):
    """The engine's client; its "failed" acks wait for `release` (a slow link)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def ack_version(self, engine_id, version, phase="loaded", *args, **kwargs):
        if phase == "failed":
            self.release.wait(10)
        return super().ack_version(engine_id, version, phase, *args, **kwargs)


def test_a_failure_of_a_plan_re_planned_meanwhile_is_not_counted(gateway):
    """The engine registered while the plan of a dead group was current (it is no member of
    it) and fails it; its FAILED ack lands after the trainer re-planned the version on a group
    that names it: the gateway ignores it (it names the old plan's seq), the engine loads the
    new plan and the trainer's wait ends "loaded", with no failure."""
    server, trainer, _ = gateway
    client = HeldFailedAcks(server.address, h.TOKENS["engine"], margin_s=5.0)
    backend = ScriptedUpdates({1: "load"})
    run = h.WorkerThread(client, backend, lease_wait_s=0.2)
    try:
        eid = run.wait_registered()
        trainer.publish_version(1, _plan("engine0-1", 1))
        _wait_for(lambda: run.worker.stats.failed_updates, "the stale plan to fail")
        trainer.publish_version(1, {**_plan(eid, 1), "group": "2"})  # the re-plan
        client.release.set()
        assert trainer.wait_sync(1, timeout_s=10) == m.SyncResult(
            True, (m.EngineSyncState(eid, 1, "loaded", "", True),)
        )
        error = (
            f"SyncPlanError: engine {eid!r} is not in the data-plane group of version 1 "
            "(members: ['engine0-1']); it joins at the next version"
        )
        assert run.worker.stats.failed_updates == [(1, error)]
        events = server.state.events
        stale = [(e["engine"], e["version"], e["phase"], e["seq"], e["current_seq"])
                 for e in events.events("stale_ack")]  # fmt: skip
        assert stale == [(eid, 1, "FAILED", 1, 2)]
        assert events.events("sync_failed") == []
        assert [(e["engine"], e["version"]) for e in events.events("loaded")] == [(eid, 1)]
        trainer.shutdown()
        assert run.join() == "shutdown"
    finally:
        client.release.set()
        client.close()


def test_update_that_broke_the_weights_stops_serving_until_one_loads(gateway):
    server, trainer, engine = gateway
    backend = ScriptedUpdates({1: "break", 2: "load"})
    backend.holds["held"] = threading.Event()
    run = h.WorkerThread(engine, backend, lease_wait_s=0.2)
    engine_id = run.wait_registered()
    held = h.prompt("held", [3, 4], n=6)
    trainer.submit_prompts([held])
    _wait_for(lambda: backend.calls == [("held", 0)], "the held prompt to start")

    trainer.publish_version(1, _plan(engine_id, 1))
    result = trainer.wait_sync(1, timeout_s=10)
    error = "RuntimeError: version 1 broke after a partial load"
    assert result == m.SyncResult(False, (m.EngineSyncState(engine_id, 1, "failed", error, False),))
    assert not run.worker.leasing and backend.weight_version is None
    # the group in flight is cancelled and its prompt released; nothing more is leased
    _wait_for(lambda: run.worker.stats.prompts_released == 1, "the held prompt's release")
    later = h.prompt("later", [5])
    trainer.submit_prompts([later])
    time.sleep(0.6)  # three lease polls' worth
    assert backend.calls == [("held", 0)]
    status = trainer.status()
    assert status.queues.pending_train == 2 and status.engines[0].serving is False

    backend.holds["held"].set()
    trainer.publish_version(2, _plan(engine_id, 2))
    assert trainer.wait_sync(2, timeout_s=10).done
    groups = trainer.fetch_rollouts(max_groups=2, timeout_s=10, min_groups=2)
    by_id = {g.sample_id: g for g in groups}
    assert sorted(by_id) == ["held", "later"]
    h.check_group(by_id["held"], held, (2, 2))
    h.check_group(by_id["later"], later, (2, 2))
    assert run.worker.stats.failed_updates == [(1, error)]
    trainer.shutdown()
    assert run.join() == "shutdown"


def test_groups_return_at_once_with_exact_tokens_and_stamps(gateway):
    server, trainer, engine = gateway
    backend = h.FakeBackend()
    backend.holds["slow"] = threading.Event()
    run = h.WorkerThread(engine, backend, max_concurrent_prompts=4, lease_batch=2)
    engine_id = run.wait_registered()
    prompts = [h.prompt("slow", [3, 4], n=6)] + [
        h.prompt(f"p{i}", [1, 2, 5 + i], g=3) for i in range(5)
    ]
    assert trainer.submit_prompts(prompts) == 6
    # the slow group holds one of 4 slots; the 5 fast ones flow past it
    fast = trainer.fetch_rollouts(max_groups=5, timeout_s=10, min_groups=5)
    assert sorted(g.sample_id for g in fast) == [f"p{i}" for i in range(5)]
    for g in fast:
        h.check_group(g, prompts[int(g.sample_id[1:]) + 1], (0, 0))
        assert g.engine_id == engine_id
        assert all(c.version_spans == ((0, 0, len(c.token_ids)),) for c in g.completions)
    backend.holds["slow"].set()
    (slow,) = trainer.fetch_rollouts(max_groups=5, timeout_s=10)
    h.check_group(slow, prompts[0], (0, 0))
    trainer.shutdown("test over")
    assert run.join() == "shutdown"
    assert run.worker.stats.groups_returned == 6
    assert sorted(pid for pid, _ in backend.calls) == ["p0", "p1", "p2", "p3", "p4", "slow"]


def test_a_return_the_gateway_took_just_before_shutdown_is_counted(gateway, monkeypatch):
    """The gateway takes the group, the trainer fetches it and shuts down, and only then does
    the reply reach the worker: the worker still counts the group (the shutdown waits up to
    `SHUTDOWN_RETURN_S` for a return in flight)."""
    server, trainer, engine = gateway
    replied = threading.Event()
    taken = engine.return_rollouts

    def late_reply(*args, **kwargs):
        out = taken(*args, **kwargs)
        replied.wait(5.0)  # the reply is held until the trainer has shut the gateway down
        return out

    monkeypatch.setattr(engine, "return_rollouts", late_reply)
    run = h.WorkerThread(engine, h.FakeBackend())
    run.wait_registered()
    p = h.prompt("p", [1, 2], g=3)
    trainer.submit_prompts([p])
    (group,) = trainer.fetch_rollouts(max_groups=1, timeout_s=10)
    h.check_group(group, p, (0, 0))
    trainer.shutdown("test over")
    time.sleep(0.3)  # the worker has seen the shutdown, its return still in flight
    replied.set()
    assert run.join() == "shutdown"
    assert run.worker.stats.groups_returned == 1


def test_refused_prompt_comes_back_as_abort_group(gateway):
    server, trainer, engine = gateway
    run = h.WorkerThread(engine, h.FakeBackend())
    run.wait_registered()
    trainer.submit_prompts([h.prompt("bad-long", [1, 2], g=3)])
    (group,) = trainer.fetch_rollouts(max_groups=1, timeout_s=10)
    assert group.sample_id == "bad-long"
    assert [c.finish_reason for c in group.completions] == ["abort"] * 3
    assert all(len(c.token_ids) == 0 and c.version_start == 0 for c in group.completions)
    trainer.shutdown()
    assert run.join() == "shutdown"
    assert run.worker.stats.prompts_aborted == 1


def test_stop_request_drains_returns_and_deregisters(gateway):
    server, trainer, engine = gateway
    backend = h.FakeBackend()
    backend.holds["stuck"] = threading.Event()
    run = h.WorkerThread(engine, backend, drain_s=0.3)
    run.wait_registered()
    trainer.submit_prompts([h.prompt("stuck", [1]), h.prompt("quick", [2])])
    (quick,) = trainer.fetch_rollouts(max_groups=1, timeout_s=10)
    assert quick.sample_id == "quick"
    run.worker.request_stop()
    assert run.join() == "stopped"
    status = trainer.status()
    assert len(status.engines) == 0  # deregistered
    assert status.queues.pending_train == 1  # the stuck prompt went back to the queue
    assert trainer.fetch_rollouts(max_groups=1, timeout_s=0.2) == []


def test_gateway_shutdown_ends_the_run_while_idle(gateway):
    server, trainer, engine = gateway
    run = h.WorkerThread(engine, h.FakeBackend(), lease_wait_s=5.0)
    run.wait_registered()
    trainer.shutdown("bye")
    # The worker is idle in a 5 s lease long-poll; shutdown must end it (join bounds the wait).
    assert run.join(timeout_s=60.0) == "shutdown"


def test_lost_gateway_ends_the_run_after_the_retry_window(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("".join(f"{role}={tok}\n" for role, tok in h.TOKENS.items()))
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--token-file", str(tokens), "--port-file",
         str(port_file), "--family", "llama", "--log-level", "WARNING"],
    )  # fmt: skip
    try:
        end = time.monotonic() + 20
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.monotonic() < end and proc.poll() is None, "gateway did not start"
            time.sleep(0.05)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        engine = GatewayClient(address, h.TOKENS["engine"], margin_s=2.0)
        run = h.WorkerThread(engine, h.FakeBackend(), gateway_retry_s=1.0, lease_wait_s=0.2)
        run.wait_registered()
        proc.kill()  # no shutdown message: the gateway just vanishes
        t0 = time.monotonic()
        assert run.join(timeout_s=30) == "lost"
        assert time.monotonic() - t0 < 15
        engine.close()
    finally:
        proc.kill()
        proc.wait(10)
