"""`WeightPublisher` with near and far engines in one plan (`launch.far_engines`), through the
real gateway, real gloo for the near engine and the real delta stream for the far one (the
engine worker loop beside each): a push commits on the near engine alone while the far
engine's load is held (the trainer never waits for it), the far engine then gets the newest
version bit for bit (skipping the ones it was too slow for) and serves it; a far engine that
dies mid-stream costs the near pushes nothing."""

import socket
import time

import pytest
import torch
from safetensors.torch import load_file

from models.params import flat_params
from tests.unit.trainer.test_publish import h  # the worker harness; fixtures: conftest.py
from trainer.publish import WeightPublisher
from transport.config import DeltaStreamTransportConfig, GlooTransportConfig, ShmTransportConfig


def _until(cond, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.02)


def _publisher(trainer, cfg):  # noqa: ANN001
    return WeightPublisher(
        trainer, GlooTransportConfig(port=0, timeout_s=20), "llama", cfg, "float32",
        ready_timeout_s=20, loaded_timeout_s=20,
        far_transport=DeltaStreamTransportConfig(port=0, timeout_s=20, keep=2),
        far_names=("engine1",),
    )  # fmt: skip


def test_pushes_commit_on_the_near_engine_while_the_far_one_loads_the_newest_on_its_own(
    model, gateway
):
    path, cfg, decoder = model
    trainer, engine = gateway
    near_backend, far_backend = h.FakeBackend(), h.FakeBackend()
    far_backend.gate.clear()  # the far engine's first load is held: a slow link
    near = h.WorkerThread(engine, near_backend, name="engine0")
    far = h.WorkerThread(engine, far_backend, name="engine1-far")
    near_id, far_id = near.wait_registered(), far.wait_registered()
    publisher = _publisher(trainer, cfg)
    params = flat_params(decoder)
    for v in (1, 2, 3):  # each push returns once the near engine loaded it
        stats = publisher.push({k: x * v for k, x in params.items()}, version=v)
        assert stats.engines == (near_id,) and stats.version == v
    assert near_backend.weight_version == 3 and far_backend.weight_version == 0
    assert [c[0]["kind"] for c in near_backend.connects] == ["gloo"]
    assert [c[0]["kind"] for c in far_backend.connects] == ["delta_stream"]
    assert far_backend.connects[0][0]["name"] == far_id
    far_backend.gate.set()  # the far engine wanted version 1: gone (kept: 2, 3); then 3
    _until(lambda: far_backend.weight_version == 3)
    reference = load_file(str(path / "model.safetensors"))
    for name, tensor in reference.items():
        assert torch.equal(far_backend.received[name], tensor * 3), name
    got = [(p["version"], p["base"], p["loaded"]) for p in publisher.delta_pushes]
    assert got == [(3, None, True)]
    assert [v for v, _ in far.worker.stats.failed_updates] == [1]  # not kept: skipped
    assert [p.version for p in publisher.pushes] == [1, 2, 3]
    prompt = h.prompt("p", [4], g=1, min_version=3)
    trainer.submit_prompts([prompt])
    (group,) = trainer.fetch_rollouts(max_groups=1, timeout_s=10)
    h.check_group(group, prompt, (3, 3))
    publisher.push({k: x * 4 for k, x in params.items()}, version=4)  # a delta against 3
    _until(lambda: far_backend.weight_version == 4)
    assert [(p["version"], p["base"]) for p in publisher.delta_pushes] == [(3, None), (4, 3)]
    trainer.shutdown()
    assert near.join() == far.join() == "shutdown"
    publisher.close()


def test_a_far_engine_that_dies_mid_stream_costs_the_near_pushes_nothing(model, gateway):
    """The far engine is stopped while its load is held (its stream ends mid-version): every
    later push commits on the near engine, the far one's stream is dropped, nothing is left
    running (the far sender's threads end with the publisher)."""
    _, cfg, decoder = model
    trainer, engine = gateway
    near_backend, far_backend = h.FakeBackend(), h.FakeBackend()
    far_backend.gate.clear()
    near = h.WorkerThread(engine, near_backend, name="engine0")
    far = h.WorkerThread(engine, far_backend, name="engine1")
    near_id = near.wait_registered()
    far.wait_registered()
    publisher = _publisher(trainer, cfg)
    params = flat_params(decoder)
    assert publisher.push(params, version=1).engines == (near_id,)
    _until(lambda: far_backend.update_started.is_set())
    far.worker.request_stop()
    far_backend.gate.set()
    assert far.join() == "stopped"
    for v in (2, 3):
        assert publisher.push({k: x * v for k, x in params.items()}, version=v).engines == (
            near_id,
        )
    assert near_backend.weight_version == 3
    trainer.shutdown()
    assert near.join() == "shutdown"
    publisher.close()


def test_far_engines_need_a_near_plane_of_whole_versions_and_both_settings(model, gateway):
    _, cfg, _ = model
    trainer, _ = gateway
    far = DeltaStreamTransportConfig(port=0)
    with pytest.raises(ValueError, match="expected far_names with far_transport"):
        WeightPublisher(trainer, GlooTransportConfig(), "llama", cfg, far_transport=far)
    with pytest.raises(ValueError, match="expected far_names with far_transport"):
        WeightPublisher(trainer, GlooTransportConfig(), "llama", cfg, far_names=("engine1",))
    with pytest.raises(ValueError, match="transport 'delta_stream'"):
        WeightPublisher(trainer, far, "llama", cfg, far_transport=far, far_names=("engine1",))
    shm = ShmTransportConfig(root="/dev/shm/x")
    WeightPublisher(trainer, shm, "llama", cfg, far_transport=far, far_names=("e1",)).close()


def test_a_far_port_already_taken_fails_when_the_publisher_is_made(model, gateway):
    _, cfg, _ = model
    trainer, _ = gateway
    with socket.create_server(("127.0.0.1", 0)) as taken:
        far = DeltaStreamTransportConfig(port=taken.getsockname()[1])
        with pytest.raises(OSError, match="in use"):
            WeightPublisher(trainer, GlooTransportConfig(), "llama", cfg, far_transport=far,
                            far_names=("engine1",))  # fmt: skip


def test_a_far_engine_that_registers_between_pushes_pulls_the_current_version_itself(
    model, gateway
):
    """A far engine that comes (or comes back) after the pushes pulls the current version from
    the plan the gateway hands it (a keyframe: it holds nothing) and serves it; the catch-up
    thread, which re-sends the current version to near engines behind it, leaves it alone."""
    path, cfg, decoder = model
    trainer, engine = gateway
    near_backend, far_backend = h.FakeBackend(), h.FakeBackend()
    near = h.WorkerThread(engine, near_backend, name="engine0")
    near.wait_registered()
    publisher = _publisher(trainer, cfg)
    publisher.start_catch_up(interval_s=0.1)
    params = flat_params(decoder)
    for v in (1, 2):
        publisher.push({k: x * v for k, x in params.items()}, version=v)
    far = h.WorkerThread(engine, far_backend, name="engine1")
    far.wait_registered()
    _until(lambda: far_backend.weight_version == 2)
    reference = load_file(str(path / "model.safetensors"))
    assert all(torch.equal(far_backend.received[n], t * 2) for n, t in reference.items())
    assert [(p["version"], p["base"]) for p in publisher.delta_pushes] == [(2, None)]
    time.sleep(0.5)  # catch-up ticks: nothing behind among the near engines
    assert [p.version for p in publisher.pushes] == [1, 2]
    prompt = h.prompt("p", [4], g=1, min_version=2)
    trainer.submit_prompts([prompt])
    (group,) = trainer.fetch_rollouts(max_groups=1, timeout_s=10)
    h.check_group(group, prompt, (2, 2))
    trainer.shutdown()
    assert near.join() == far.join() == "shutdown"
    publisher.close()
