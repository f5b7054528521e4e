"""The engine worker loop against the real gateway on loopback, with a small backend beside it
whose outputs are known exactly: lease, generate concurrently, return with version stamps,
refuse what it cannot serve, and stop cleanly (stop request, gateway shutdown, lost gateway)."""

import importlib.util
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gateway.client import GatewayClient

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
        assert all(c.version_spans == () for c in g.completions)
    backend.holds["slow"].set()
    (slow,) = trainer.fetch_rollouts(max_groups=5, timeout_s=10)
    h.check_group(slow, prompts[0], (0, 0))
    trainer.shutdown("test over")
    assert run.join() == "shutdown"
    assert run.worker.stats.groups_returned == 6
    assert sorted(pid for pid, _ in backend.calls) == ["p0", "p1", "p2", "p3", "p4", "slow"]


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
