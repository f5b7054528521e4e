"""Elastic pushes through the real gateway and real gloo: an engine process SIGKILLed in the
middle of the data-plane send is dropped from the push (the gateway drops it because its
heartbeat long poll broke, which names it), the publisher forms a new group of the two
survivors and re-sends the same version, which commits on them with exact tensors; with
`min_engines` above the survivors the push fails naming the engine that left."""

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from models.checkpoints.hf_io import load_hf_checkpoint
from models.params import flat_params
from trainer.publish import PushError, WeightPublisher
from transport.config import GlooTransportConfig

_here = Path(__file__).parent
_spec = importlib.util.spec_from_file_location(
    "worker_harness", _here.parent / "rollout_engine" / "worker_harness.py"
)
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)

BUCKET = 48 * 1024  # several buckets for the tiny model (about 0.6 MB in float32)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    path = tiny_checkpoint("llama", seed=5)
    cfg, decoder = load_hf_checkpoint(path, dtype="float32")
    return path, cfg, decoder


@contextlib.contextmanager
def _gateway_and_dying_engine(die_at: str):
    """A gateway (heartbeat timeout 60 s: only a broken long poll drops a dead engine in time)
    and an engine process that loads version 1 and dies of its own SIGKILL at bucket `die_at`
    ("-1": after the load, before acking it; `dying_engine.py`). Yields (server, trainer,
    engine channel, dying process, runs): the worker threads the test appends to `runs` are
    joined on exit, and everything is stopped."""
    server, trainer, engine = h.start_gateway(heartbeat_timeout_s=60.0, max_wait_s=20.0)
    env = {**os.environ, "PYTHONPATH": str(_here.parents[2])}
    argv = [sys.executable, str(_here / "dying_engine.py"), server.address, h.TOKENS["engine"]]
    dying = subprocess.Popen([*argv, "1", die_at], stdout=subprocess.PIPE, text=True, env=env)
    runs: list = []
    try:
        yield server, trainer, engine, dying, runs
    finally:
        dying.kill()
        trainer.shutdown()
        for r in runs:
            r.join()
        trainer.close()
        engine.close()
        server.stop(0)


@contextlib.contextmanager
def _dies_after_loading_then_rejoins(backend):
    """`_gateway_and_dying_engine("-1")`, and, once the engine is dead, a worker thread over
    `backend` registering in its place (as the launcher restarts it, or a frozen engine
    rejoins). Yields (server, trainer, doomed engine id, dying process, runs); the rejoined
    worker is ``runs[0]`` once the process died."""
    with _gateway_and_dying_engine("-1") as (server, trainer, engine, dying, runs):

        def rejoin() -> None:
            dying.wait(60)
            runs.append(h.WorkerThread(engine, backend, lease_wait_s=0.2))

        rejoiner = threading.Thread(target=rejoin, daemon=True)
        try:
            doomed = dying.stdout.readline().strip()
            rejoiner.start()
            yield server, trainer, doomed, dying, runs
        finally:
            dying.kill()
            if rejoiner.ident is not None:
                rejoiner.join(60)


@pytest.mark.parametrize("min_engines", [1, 3])
def test_an_engine_killed_during_the_send_is_dropped_and_the_version_commits(model, min_engines):
    path, cfg, decoder = model
    backends = [h.FakeBackend(), h.FakeBackend()]
    with _gateway_and_dying_engine("2") as (server, trainer, engine, dying, runs):
        runs += [h.WorkerThread(engine, b, lease_wait_s=0.2) for b in backends]
        survivors = sorted(r.wait_registered() for r in runs)
        doomed = dying.stdout.readline().strip()
        transport = GlooTransportConfig(port=0, timeout_s=30, bucket_bytes=BUCKET)
        publisher = WeightPublisher(
            trainer, transport, "llama", cfg, "float32",
            ready_timeout_s=30 if min_engines == 1 else 3, min_engines=min_engines,
        )  # fmt: skip
        if min_engines == 3:
            with pytest.raises(PushError) as e:
                publisher.push(decoder, version=1)
            assert str(e.value) == (
                "push of version 1: expected at least launch.min_engines=3 engines serving, "
                f"got 2 within 3 s after {[doomed]} left during the push"
            )
            assert dying.wait(10) == -9
            return
        stats = publisher.push(decoder, version=1)
        assert dying.wait(10) == -9  # it died of its own SIGKILL at bucket 2
        assert (stats.version, stats.engines, stats.dropped) == (1, tuple(survivors), (doomed,))
        assert stats.attempts == 2 and stats.num_buckets > 2
        reference = load_file(str(path / "model.safetensors"))
        for b, run in zip(backends, runs, strict=True):
            assert b.weight_version == 1
            assert all(torch.equal(b.received[n], t.float()) for n, t in reference.items())
            assert [c[2] for c in b.connects] == [4, 3]  # the group of 4, then of 3
            failed = run.worker.stats.failed_updates
            assert [v for v, _ in failed] == [1] and "TransferError" in failed[0][1]
        events = server.state.events
        assert [e["engine"] for e in events.events("dropped")] == [doomed]
        assert "long poll was cancelled" in events.events("dropped")[0]["reason"]
        published = [(e["version"], e["replan"]) for e in events.events("published")]
        assert published == [(1, False), (1, True)]
        loaded = sorted(e["engine"] for e in events.events("loaded"))
        assert loaded == survivors
        publisher.close()


def test_the_only_engine_dying_after_the_commit_waits_for_its_restart(model):
    """The only engine loads version 1 (the data plane committed) and dies before acking it:
    the push waits for its restart (within `ready_timeout_s`, as before the commit) and
    re-plans the version on the restarted engine, which loads it exactly."""
    path, cfg, decoder = model
    reborn = h.FakeBackend()
    with _dies_after_loading_then_rejoins(reborn) as (server, trainer, doomed, dying, runs):
        transport = GlooTransportConfig(port=0, timeout_s=30, bucket_bytes=BUCKET)
        publisher = WeightPublisher(trainer, transport, "llama", cfg, "float32", ready_timeout_s=30)
        stats = publisher.push(decoder, version=1)
        assert dying.wait(10) == -9  # it died of its own SIGKILL after loading version 1
        (run,) = runs
        new_id = run.wait_registered()
        assert (stats.version, stats.engines, stats.dropped) == (1, (new_id,), (doomed,))
        assert stats.attempts == 2
        reference = load_file(str(path / "model.safetensors"))
        assert reborn.weight_version == 1
        assert all(torch.equal(reborn.received[n], t.float()) for n, t in reference.items())
        events = server.state.events
        assert [e["engine"] for e in events.events("dropped")] == [doomed]
        published = [(e["version"], e["replan"]) for e in events.events("published")]
        assert published == [(1, False), (1, True)]
        assert [(e["engine"], e["version"]) for e in events.events("loaded")] == [(new_id, 1)]
        publisher.close()


def test_the_only_engine_coming_back_holding_the_version_ends_the_push_without_a_resend(model):
    """The only engine loads version 1 and leaves before acking it, then registers again
    holding it (as a frozen engine that finished its load when thawed and rejoined over the
    same backend): the push ends on it, with no re-plan and nothing sent again (CI once saw
    the re-plan wait 120 s for a "ready" such an engine never sends)."""
    path, cfg, decoder = model
    back = h.FakeBackend()
    back._version = 1  # the backend kept what it loaded before it left
    with _dies_after_loading_then_rejoins(back) as (server, trainer, doomed, dying, runs):
        transport = GlooTransportConfig(port=0, timeout_s=30, bucket_bytes=BUCKET)
        publisher = WeightPublisher(trainer, transport, "llama", cfg, "float32", ready_timeout_s=30)
        stats = publisher.push(decoder, version=1)
        assert dying.wait(10) == -9  # it died of its own SIGKILL after loading version 1
        (run,) = runs
        new_id = run.wait_registered()
        assert (stats.version, stats.engines, stats.dropped) == (1, (new_id,), (doomed,))
        assert (stats.attempts, stats.num_buckets, stats.sent_bytes) == (1, 0, 0)  # one group
        assert stats.seconds < 30  # not the ready timeout
        assert back.connects == [] and back.received == {}  # nothing sent to it again
        events = server.state.events
        published = [(e["version"], e["replan"]) for e in events.events("published")]
        assert published == [(1, False)]
        registered = [(e["engine"], e["weight_version"]) for e in events.events("registered")]
        assert registered[-1] == (new_id, 1)
        trainer.submit_prompts([h.prompt(f"q{i}", [i + 1], min_version=1) for i in range(4)])
        assert len(trainer.fetch_rollouts(max_groups=4, timeout_s=10, min_groups=4)) == 4
        publisher.close()


def test_an_engine_registering_between_pushes_is_caught_up_to_the_current_version(model):
    path, cfg, decoder = model
    server, trainer, engine = h.start_gateway()
    first = h.FakeBackend()
    runs = [h.WorkerThread(engine, first, lease_wait_s=0.2)]
    try:
        a = runs[0].wait_registered()
        transport = GlooTransportConfig(port=0, timeout_s=30, bucket_bytes=BUCKET)
        publisher = WeightPublisher(trainer, transport, "llama", cfg, "float32")
        publisher.start_catch_up(interval_s=0.05)
        assert publisher.push(decoder, version=1).engines == (a,)
        late = h.FakeBackend()  # as a restarted engine: registers at 0 while 1 is current
        runs.append(h.WorkerThread(engine, late, lease_wait_s=0.2))
        b = runs[1].wait_registered()
        deadline = time.monotonic() + 30
        while late.weight_version != 1:
            assert time.monotonic() < deadline, "the late engine was never caught up"
            time.sleep(0.02)
        reference = load_file(str(path / "model.safetensors"))
        assert all(torch.equal(late.received[n], t.float()) for n, t in reference.items())
        assert [c[1:] for c in late.connects] == [(1, 2)]  # a group of the late engine alone
        trainer.submit_prompts([h.prompt(f"q{i}", [i + 1], min_version=1) for i in range(8)])
        groups = trainer.fetch_rollouts(max_groups=8, timeout_s=10, min_groups=8)
        assert len(groups) == 8
        events = server.state.events
        published = [(e["version"], e["replan"]) for e in events.events("published")]
        assert published == [(1, False), (1, True)]
        mine = [e["event"] for e in events.events() if e.get("engine") == b]
        assert mine[0] == "registered" and "leased" not in mine[: mine.index("loaded")]
        assert publisher.catch_up() == ()  # nobody is behind any more
        kept = publisher._last[1]
        tripled = {k: np.asarray(v) * 3 for k, v in flat_params(decoder).items()}
        assert sorted(publisher.push(tripled, version=2).engines) == sorted([a, b])
        assert publisher._last[0] == 2 and publisher._last[1] is not kept
        for name, buf in publisher._last[1].items():  # the same buffers, holding version 2
            assert buf is kept[name]
            assert torch.equal(torch.from_numpy(buf), reference[name].float() * 3), name
        publisher.close()
    finally:
        trainer.shutdown()
        for r in runs:
            r.join()
        trainer.close()
        engine.close()
        server.stop(0)


def test_catching_up_with_the_gateway_gone_says_so_once(model, caplog):
    """A gateway that stops while the catch-up thread runs (the job's forced stop) is one
    warning line, not a traceback every tick."""
    path, cfg, decoder = model
    server, trainer, engine = h.start_gateway()
    transport = GlooTransportConfig(port=0, timeout_s=30, bucket_bytes=BUCKET)
    publisher = WeightPublisher(trainer, transport, "llama", cfg, "float32")
    try:
        publisher._last = (1, {})  # as after a push: something to catch up to
        server.stop(0)
        with caplog.at_level("WARNING", logger="trainer.publish"):
            publisher.start_catch_up(interval_s=0.05)
            time.sleep(1.5)  # about 30 ticks
            publisher.close()
        records = [r for r in caplog.records if r.name == "trainer.publish"]
        assert len(records) == 1, [r.getMessage() for r in records]
        assert records[0].levelname == "WARNING" and records[0].exc_info is None
        assert records[0].getMessage().startswith("catching engines up: UNAVAILABLE")
    finally:
        publisher.close()
        trainer.close()
        engine.close()
