"""A collective push pins a member's failure on the engine that died: between two pushes to the
same engines the data-plane group stays, so the members that ack "ready" go straight into the
receive on it; when another member dies instead of acking "ready", their receive fails
("Connection reset by peer": gloo's broadcast runs down a tree through the dead rank) and
they ack "failed" before the gateway drops the dead engine. The publisher waits up to
`peer_grace_s` for that drop and re-plans the version on the survivors, instead of failing
the push on the survivor's error (seen in CI with three engines and two SIGKILLs).

The engines here are gateway clients acking by hand (the control plane only: no data is
sent), so the order of the failure and the drop is exact."""

import contextlib
import threading
import time

import pytest

from gateway import messages as m
from models.checkpoints.hf_io import load_hf_checkpoint
from tests.unit.trainer.test_publish_silence import h
from trainer.publish import PushError, WeightPublisher
from transport.config import GlooTransportConfig
from transport.sync_plan import SyncPlan, SyncPlanError

RESET = "TransferError: receiving version 1 failed: Read error: Connection reset by peer"


def _published(server, n: int, timeout_s: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while len(events := server.state.events.events("published")) < n:
        assert time.monotonic() < deadline, f"expected {n} publications, got {events}"
        time.sleep(0.02)
    return events


@contextlib.contextmanager
def _pushing_to_three(tiny_checkpoint, transport_timeout_s, **waits):
    """A gateway with three hand-acking engines and a publisher pushing version 1 to them in
    a thread; yields (server, engine client, the three ids, the push's outcome dict)."""
    cfg, decoder = load_hf_checkpoint(tiny_checkpoint("llama", seed=3), dtype="float32")
    server, trainer, engine = h.start_gateway(heartbeat_timeout_s=60.0)
    spec = m.EngineSpec(backend="jax", model_family="llama", dtype="float32",
                        transports=("gloo",))  # fmt: skip
    ids = tuple(engine.register_engine(spec).engine_id for _ in range(3))
    transport = GlooTransportConfig(port=0, timeout_s=transport_timeout_s)
    publisher = WeightPublisher(trainer, transport, "llama", cfg, "float32", **waits)
    out: dict = {}

    def push() -> None:
        try:
            out["stats"] = publisher.push(decoder, version=1)
        except PushError as e:
            out["error"] = e

    thread = threading.Thread(target=push)
    try:
        thread.start()
        yield server, engine, ids, out
        thread.join(60)
        assert not thread.is_alive()
    finally:
        thread.join(60)
        publisher.close()
        trainer.close()
        engine.close()
        server.stop(0)


@pytest.mark.parametrize("dies", [True, False])
def test_a_survivors_failure_is_pinned_on_the_member_that_died(tiny_checkpoint, dies):
    waits = dict(ready_timeout_s=3.0, settle_s=1.0, peer_grace_s=5.0)
    with _pushing_to_three(tiny_checkpoint, 30, **waits) as (server, engine, ids, out):
        first, doomed, last = ids
        assert _published(server, 1)[0]["engines"] == [first, doomed, last]
        engine.ack_version(first, 1, "ready")
        engine.ack_version(last, 1, "failed", RESET, serving=True)  # rank 3 of the group
        time.sleep(0.5)  # the failure is seen before the drop
        if dies:  # else nobody leaves within peer_grace_s: the survivor's own error fails it
            engine.deregister(doomed)  # as the gateway drops it when its long poll breaks
            replan = _published(server, 2)[1]
            assert (replan["version"], replan["replan"]) == (1, True)
            assert replan["engines"] == [first, last]
            plan = SyncPlan.from_params(engine.heartbeat(first).sync.params, 1)
            assert sorted(plan.ranks) == [first, last] and plan.world_size == 3
            with pytest.raises(SyncPlanError):
                plan.rank_of(doomed)
    if dies:  # the new group waits for "ready" from both survivors; they never ack here
        assert "not ready" in str(out["error"]) and "ready_timeout_s" in str(out["error"])
    else:
        assert "engines failed" in str(out["error"]) and RESET in str(out["error"])
        assert len(server.state.events.events("published")) == 1


def test_a_member_that_died_before_joining_the_group_is_replanned_without(tiny_checkpoint):
    """Every member acks "ready", one dies before it joins the data-plane group (seen in CI:
    a vLLM engine SIGKILLed right after its ack held the trainer in the process-group
    constructor for the transport's 300 s, and the run died). The sender gives up on the
    group as soon as the gateway drops that member and the push re-plans on the survivors,
    long before `timeout_s`."""
    waits = dict(ready_timeout_s=2.0, settle_s=0.5, peer_grace_s=2.0)
    with _pushing_to_three(tiny_checkpoint, 120, **waits) as (server, engine, ids, out):
        first, doomed, last = ids
        _published(server, 1)
        for e in ids:
            engine.ack_version(e, 1, "ready")  # none of them joins the group here
        time.sleep(1.0)
        t0 = time.monotonic()
        engine.deregister(doomed)  # as the gateway drops it when its long poll breaks
        replan = _published(server, 2, timeout_s=20.0)[1]
        assert time.monotonic() - t0 < 10.0  # the group's wait ended on the drop, not at 120 s
        assert (replan["version"], replan["replan"], replan["engines"]) == (1, True, [first, last])
    # the survivors never ack the new plan here: its "ready" wait runs out
    assert "not ready" in str(out["error"]) and "ready_timeout_s" in str(out["error"])
