"""`WeightPublisher` pushing a tiny llama's JAX params through the real gateway and real gloo
to the engine worker loop (the backend beside it receives through a real transport receiver):
exact tensors in the wire dtype, version stamps across an update, no leases while syncing,
a failed update that refuses leases until a good one, and bad input."""

import importlib.util
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from models.params import flat_params
from trainer.publish import PushError, WeightPublisher
from transport.config import FileTransportConfig, GlooTransportConfig
from transport.expected import checkpoint_tensors

_path = Path(__file__).parents[1] / "rollout_engine" / "worker_harness.py"
_spec = importlib.util.spec_from_file_location("worker_harness", _path)
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)

BUCKET = 48 * 1024  # several buckets for the tiny model (about 0.3 MB in bf16)


def _publisher(trainer, cfg, dtype):
    transport = GlooTransportConfig(port=0, timeout_s=20, bucket_bytes=BUCKET)
    return WeightPublisher(trainer, transport, "llama", cfg, dtype, ready_timeout_s=20)


def test_push_streams_exact_tensors_and_stamps_the_switch(model, gateway):
    path, cfg, decoder = model
    trainer, engine = gateway
    backend = h.FakeBackend(step_s=0.001, expected=checkpoint_tensors(path, "bfloat16"))
    backend.holds["held"] = threading.Event()
    run = h.WorkerThread(engine, backend)
    engine_id = run.wait_registered()
    held = h.prompt("held", [5, 6], g=2, n=8)
    trainer.submit_prompts([held])
    while not any(pid == "held" for pid, _ in backend.calls):
        time.sleep(0.01)
    publisher = _publisher(trainer, cfg, "bfloat16")
    stats = publisher.push(decoder, version=1)

    reference = load_file(str(path / "model.safetensors"))
    assert set(backend.received) == set(reference)
    for name, tensor in reference.items():
        assert backend.received[name].dtype == torch.bfloat16
        assert torch.equal(backend.received[name], tensor.to(torch.bfloat16)), name
    assert stats.version == 1 and stats.engines == (engine_id,)
    assert stats.num_bytes == sum(2 * t.numel() for t in reference.values())
    assert stats.num_buckets == len(publisher.manifest(1).buckets()) > 1
    assert stats.gb_per_s > 0 and stats.seconds >= stats.send_s > 0

    backend.holds["held"].set()  # the held sample made 4 tokens at v0, the rest at v1
    (group,) = trainer.fetch_rollouts(max_groups=1, timeout_s=10)
    h.check_group(group, held, (0, 1))
    assert all(c.version_spans == ((0, 0, 4), (1, 4, 8)) for c in group.completions)
    fresh = h.prompt("fresh", [7], g=1)
    trainer.submit_prompts([fresh])
    (group,) = trainer.fetch_rollouts(max_groups=1, timeout_s=10)
    h.check_group(group, fresh, (1, 1))

    params = {k: v * 2 for k, v in flat_params(decoder).items()}  # a second version
    publisher.push(params, version=2)
    assert len(backend.connects) == 1  # the group is kept across versions
    for name, tensor in reference.items():
        assert torch.equal(backend.received[name], (tensor * 2).to(torch.bfloat16)), name
    trainer.shutdown()
    assert run.join() == "shutdown"
    assert [u.version for u in run.worker.stats.updates] == [1, 2]
    publisher.close()


def test_no_leases_while_an_update_is_in_progress(model, gateway):
    path, cfg, decoder = model
    trainer, engine = gateway
    backend = h.FakeBackend()
    backend.gate.clear()
    run = h.WorkerThread(engine, backend, lease_wait_s=0.2)
    run.wait_registered()
    publisher = _publisher(trainer, cfg, "float32")
    pushed: list = []
    pusher = threading.Thread(target=lambda: pushed.append(publisher.push(decoder, 1)))
    pusher.start()
    assert backend.update_started.wait(10)
    time.sleep(0.5)  # longer than a lease poll already under way when the directive came
    prompts = [h.prompt("a", [1]), h.prompt("b", [2])]
    trainer.submit_prompts(prompts)
    time.sleep(0.5)
    assert backend.calls == [] and trainer.status().queues.pending_train == 2
    backend.gate.set()
    pusher.join(30)
    assert [s.version for s in pushed] == [1]
    reference = load_file(str(path / "model.safetensors"))
    assert all(torch.equal(backend.received[n], t) for n, t in reference.items())
    groups = trainer.fetch_rollouts(max_groups=2, timeout_s=10, min_groups=2)
    for g in groups:
        h.check_group(g, prompts["ab".index(g.sample_id)], (1, 1))
    trainer.shutdown()
    assert run.join() == "shutdown"
    publisher.close()


def test_failed_update_refuses_leases_until_a_good_one(model, gateway):
    path, cfg, decoder = model
    trainer, engine = gateway
    backend = h.FakeBackend()
    backend.fail_at[1] = 1  # bucket 0 loads, bucket 1 fails: no whole version held
    run = h.WorkerThread(engine, backend, lease_wait_s=0.2)
    engine_id = run.wait_registered()
    publisher = _publisher(trainer, cfg, "float32")
    with pytest.raises(PushError, match="injected failure at bucket 1") as info:
        publisher.push(decoder, version=1)
    assert [(e.engine_id, e.phase) for e in info.value.engines] == [(engine_id, "failed")]
    assert backend.weight_version is None
    trainer.submit_prompts([h.prompt("later", [9])])
    time.sleep(0.6)
    assert backend.calls == []  # refused to serve: nothing leased
    assert trainer.status().queues.pending_train == 1
    params = {k: np.asarray(v) + 1 for k, v in flat_params(decoder).items()}
    stats = publisher.push(params, version=2)
    assert stats.version == 2 and len(backend.connects) == 2  # a fresh group after a failure
    reference = load_file(str(path / "model.safetensors"))
    assert all(torch.equal(backend.received[n], t + 1) for n, t in reference.items())
    (group,) = trainer.fetch_rollouts(max_groups=1, timeout_s=10)
    h.check_group(group, h.prompt("later", [9]), (2, 2))
    assert run.worker.stats.failed_updates[0][0] == 1
    trainer.shutdown()
    assert run.join() == "shutdown"
    publisher.close()


def test_bad_input(model, gateway):
    _, cfg, decoder = model
    trainer, _ = gateway
    with pytest.raises(ValueError, match="dtype: expected one of"):
        _publisher(trainer, cfg, "int8")
    with pytest.raises(ValueError, match="min_engines, max_attempts: expected >= 1"):
        WeightPublisher(trainer, GlooTransportConfig(), "llama", cfg, min_engines=0)
    transport = GlooTransportConfig(port=0, timeout_s=20, bucket_bytes=BUCKET)
    publisher = WeightPublisher(trainer, transport, "llama", cfg, ready_timeout_s=0.3)
    with pytest.raises(
        PushError,
        match=r"push of version 1: expected at least launch.min_engines=1 engines serving, "
        r"got 0 within 0.3 s",
    ):
        publisher.push(decoder, version=1)


def test_two_engines_then_a_late_joiner(model, gateway):
    path, cfg, decoder = model
    trainer, engine = gateway
    backends = [h.FakeBackend(), h.FakeBackend()]
    runs = [h.WorkerThread(engine, b, lease_wait_s=0.2) for b in backends]
    ids = sorted(r.wait_registered() for r in runs)
    publisher = _publisher(trainer, cfg, "float32")
    assert publisher.push(decoder, version=1).engines == tuple(ids)
    assert sorted((c[1], c[2]) for b in backends for c in b.connects) == [(1, 3), (2, 3)]

    late = h.FakeBackend()  # registers at version 1, outside the group that carried it
    runs.append(h.WorkerThread(engine, late, lease_wait_s=0.2))
    late_id = runs[-1].wait_registered()
    deadline = time.monotonic() + 10
    while not runs[-1].worker.stats.failed_updates:
        assert time.monotonic() < deadline, "the late engine never saw version 1"
        time.sleep(0.02)
    (version, error) = runs[-1].worker.stats.failed_updates[0]
    assert version == 1 and f"engine {late_id!r} is not in the data-plane group" in error

    params = {k: np.asarray(v) * 3 for k, v in flat_params(decoder).items()}
    stats = publisher.push(params, version=2)  # a new group of all three
    assert sorted(stats.engines) == sorted([*ids, late_id])
    reference = load_file(str(path / "model.safetensors"))
    for b in [*backends, late]:
        assert b.weight_version == 2
        assert all(torch.equal(b.received[n], t * 3) for n, t in reference.items())
        assert b.connects[-1][2] == 4  # 1 sender + 3 receivers
    assert sorted(b.connects[-1][1] for b in [*backends, late]) == [1, 2, 3]
    prompts = [h.prompt(f"q{i}", [i + 1]) for i in range(6)]
    trainer.submit_prompts(prompts)
    groups = trainer.fetch_rollouts(max_groups=6, timeout_s=10, min_groups=6)
    for g in groups:
        h.check_group(g, prompts[int(g.sample_id[1:])], (2, 2))
    trainer.shutdown()
    assert [r.join() for r in runs] == ["shutdown"] * 3
    publisher.close()


def test_push_over_the_file_transport(model, gateway, tmp_path):
    path, cfg, decoder = model
    trainer, engine = gateway
    backend = h.FakeBackend()
    run = h.WorkerThread(engine, backend)
    run.wait_registered()
    transport = FileTransportConfig(root=str(tmp_path / "weights"), timeout_s=20)
    publisher = WeightPublisher(trainer, transport, "llama", cfg, "bfloat16")
    assert publisher.push(decoder, version=1).version == 1
    reference = load_file(str(path / "model.safetensors"))
    for name, tensor in reference.items():
        assert torch.equal(backend.received[name], tensor.to(torch.bfloat16)), name
    assert backend.connects[0][0]["kind"] == "file"
    trainer.shutdown()
    assert run.join() == "shutdown"
