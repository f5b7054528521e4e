"""The single-process side of `trainer.distributed`, `trainer.global_batch` and the placement
helpers of `models.sharding` (the 2-process runs are in tests/integration/
test_multiprocess_step.py)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gateway.messages import Completion
from models.sharding import host_value, make_mesh, mesh_devices, place, put
from trainer.batch import build_rl_batch
from trainer.distributed import ProcessGroup, initialize
from trainer.global_batch import FIELDS, batch_fields, share_batch
from trainer.rollouts import RolloutGroup


def _batch():
    comps = [
        Completion([5, 6], [-1.0, -2.0], "stop", 0, 0, reward=1.0),
        Completion([7], [-0.5], "length", 0, 0, reward=0.0),
    ]
    return build_rl_batch([RolloutGroup("a", [1, 2, 3], comps)])


def test_mesh_devices_per_process():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices")
    assert mesh_devices() == sorted(jax.devices(), key=lambda d: d.id)
    assert [d.id for d in mesh_devices(4)] == sorted(d.id for d in jax.devices())[:4]
    with pytest.raises(ValueError, match="process 0 has 8 devices, fewer than the 9"):
        mesh_devices(9)


@pytest.mark.parametrize(
    "group, match",
    [
        (ProcessGroup(num_processes=2, process_id=2), r"process_id must be in \[0, 2\); got 2"),
        (ProcessGroup(num_processes=0), "num_processes must be >= 1; got 0"),
        (ProcessGroup(local_devices=0), "local_devices must be >= 1; got 0"),
        (ProcessGroup(init_timeout_s=0), "init_timeout_s must be >= 1 s; got 0"),
    ],
)
def test_process_group_refuses_impossible_settings(group, match):
    with pytest.raises(ValueError, match=match):
        initialize(group)


def test_cpu_settings_after_the_backend_started_are_refused():
    jax.devices()  # the backend runs in this test process
    with pytest.raises(RuntimeError, match="backend already started"):
        initialize(ProcessGroup(num_processes=1, local_devices=2))
    # off CPU nothing is set, and one process joins nothing
    assert initialize(ProcessGroup(num_processes=1, platform="gpu")) == (0, 1)


def test_share_batch_with_one_process():
    batch = _batch()
    assert share_batch(batch) is batch
    with pytest.raises(ValueError, match="a single process must pass its batch"):
        share_batch(None)


def test_batch_fields_match_build_rl_batch_and_name_a_wrong_one():
    batch = _batch()
    fields = batch_fields(batch)
    # routes (routing replay, optional and of their own rank) are not shared across trainer
    # processes: the job config refuses replay with several (test_batch_routes.py)
    assert set(fields) == set(FIELDS) == {f.name for f in dataclasses.fields(batch)} - {"routes"}
    assert fields["tokens"].shape == (2, 8) and fields["rewards"].tolist() == [1.0, 0.0]
    bad = dataclasses.replace(batch, loss_mask=batch.loss_mask.astype(np.float64))
    with pytest.raises(ValueError, match=r"RLBatch.loss_mask: expected \(2, 8\) float32"):
        batch_fields(bad)


def test_place_put_and_host_value_on_one_process():
    mesh = make_mesh(1, 4, devices=jax.devices()[:4])
    sharding = NamedSharding(mesh, P("fsdp", None))
    host = np.arange(32, dtype=np.float32).reshape(8, 4)
    placed = place(host, sharding)
    assert placed.sharding == sharding
    assert {s.data.shape for s in placed.addressable_shards} == {(2, 4)}
    np.testing.assert_array_equal(host_value(placed), host)
    copied = put(placed, sharding)
    pointers = [
        (a.data.unsafe_buffer_pointer(), b.data.unsafe_buffer_pointer())
        for a, b in zip(copied.addressable_shards, placed.addressable_shards, strict=True)
    ]
    assert all(a != b for a, b in pointers)  # a copy: donating `copied` leaves `placed`
    np.testing.assert_array_equal(np.asarray(copied), host)
    replicated = put(host, NamedSharding(mesh, P()))
    assert float(host_value(replicated.sum())) == float(host.sum())
