"""Engine drops, the event log, newcomers and re-plans on the gateway.

On a fake clock (GatewayState): a broken connection drops the engine and sends its leases back
at once, logged as events; an engine that registers behind the current version leases only
after it loaded it; publishing the current version again with a new plan is a re-plan. On a
real server: an engine process SIGKILLed during its heartbeat long poll is dropped because
the long poll broke (the heartbeat timeout is far longer than the test), its two leased
prompts go back to the queue, and another engine leases them.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.client import GatewayClient
from gateway.config import GatewayConfig, RunSettings
from gateway.errors import GatewayError
from gateway.events import EventLog, read_events
from gateway.server import GatewayServer
from gateway.state import GatewayState
from protos import gateway_pb2 as gpb


def _state(gw, tmp_path=None):
    clock = gw.FakeClock()
    cfg = GatewayConfig(
        settings=RunSettings(model_family="llama"), lease_seconds=30.0, heartbeat_timeout_s=10.0
    )
    events = EventLog(tmp_path / "events.jsonl" if tmp_path else None, clock=lambda: clock.t)
    return GatewayState(cfg, clock=clock, events=events), clock


KEYS: dict[str, str] = {}  # engine id -> the engine_key its registration returned


def _register(state, request):
    reply = state.register(request)
    KEYS[reply.engine_id] = reply.engine_key
    return reply


def _lease(state, engine_id, n):
    return state.lease(
        gpb.LeaseRequest(
            engine_id=engine_id, engine_key=KEYS[engine_id], max_prompts=n, timeout_s=0.0
        )
    )


def _beat(engine_id, **kw):
    return gpb.HeartbeatRequest(engine_id=engine_id, engine_key=KEYS[engine_id], **kw)


def _kinds(state, engine_id):
    return [e["event"] for e in state.events.events() if e.get("engine") == engine_id]


def _ack(state, engine_id, version, phase, serving=False):
    return state.ack(
        gpb.AckRequest(
            engine_id=engine_id,
            engine_key=KEYS[engine_id],
            version=version,
            phase=phase,
            serving=serving,
        )
    )


def test_a_broken_connection_requeues_the_leases_at_once_and_is_logged(gw, tmp_path):
    state, _ = _state(gw, tmp_path)
    a = _register(state, gw.register(name="a")).engine_id
    b = _register(state, gw.register(name="b")).engine_id
    state.submit(gpb.SubmitRequest(prompts=[gw.prompt(f"p{i}") for i in range(3)]))
    assert [p.sample_id for p in _lease(state, a, 2).prompts] == ["p0", "p1"]
    assert state.peer_lost(a, "not its key", "forged") is False  # another caller cannot drop it
    assert state.peer_lost(a, KEYS[a], "its connection dropped") is True
    assert state.peer_lost(a, KEYS[a], "again") is False  # unknown now: a no-op
    assert _kinds(state, a) == ["registered", "leased", "dropped", "leases_requeued"]
    requeued = state.events.events("leases_requeued")
    assert [(e["engine"], e["leases"], e["prompts"]) for e in requeued] == [(a, 1, 2)]
    assert state.events.events("dropped")[0]["reason"] == "its connection dropped"
    assert [p.sample_id for p in _lease(state, b, 5).prompts] == ["p0", "p1", "p2"]
    assert state.status().counters.engines_lost == 1
    with pytest.raises(GatewayError, match="missed heartbeats or left; register again"):
        _lease(state, a, 1)
    on_disk = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert on_disk == [e["event"] for e in state.events.events()]


def test_an_engine_registering_behind_leases_only_after_the_current_version(gw):
    state, _ = _state(gw)
    old = _register(state, gw.register(name="old")).engine_id
    for v in (1, 2):
        state.publish(gpb.PublishRequest(version=v, params={"group": str(v)}))
        _ack(state, old, v, gpb.SYNC_PHASE_LOADED)
    state.submit(gpb.SubmitRequest(prompts=[gw.prompt("p0", min_version=0)]))
    reg = _register(state, gw.register(name="new"))
    assert reg.sync.target_version == 2 and reg.sync.pending
    new = reg.engine_id
    assert _lease(state, new, 1).lease_id == ""  # version 0 held, 2 is current
    _ack(state, new, 1, gpb.SYNC_PHASE_LOADED)
    assert _lease(state, new, 1).lease_id == ""  # still behind the version it joined at
    _ack(state, new, 2, gpb.SYNC_PHASE_LOADED)
    assert [p.sample_id for p in _lease(state, new, 1).prompts] == ["p0"]
    assert _kinds(state, new) == ["registered", "loaded", "loaded", "leased"]
    first = state.events.events("registered")[-1]
    assert (first["weight_version"], first["current"]) == (0, 2)


def test_publishing_the_current_version_with_a_new_plan_is_a_replan(gw):
    state, _ = _state(gw)
    a = _register(state, gw.register(name="a")).engine_id
    b = _register(state, gw.register(name="b")).engine_id
    with pytest.raises(GatewayError, match="versions only increase"):
        state.publish(gpb.PublishRequest(version=0, params={"group": "9"}))
    state.publish(gpb.PublishRequest(version=1, params={"group": "1"}))
    for eid in (a, b):  # both saw the directive of the first plan
        assert state.heartbeat(_beat(eid)).sync.params["group"] == "1"
    _ack(state, a, 1, gpb.SYNC_PHASE_FAILED, serving=True)  # the group broke
    _ack(state, b, 1, gpb.SYNC_PHASE_READY)
    with pytest.raises(GatewayError, match="versions only increase"):
        state.publish(gpb.PublishRequest(version=1, params={"group": "1"}))
    state.publish(gpb.PublishRequest(version=1, params={"group": "2"}))
    sync = {s.engine_id: s for s in state.wait_sync(gpb.WaitSyncRequest(
        version=1, phase=gpb.SYNC_PHASE_LOADED, timeout_s=0.0)).engines}  # fmt: skip
    # the broken attempt's acks are forgotten: neither failed nor ready for version 1
    assert [(sync[e].version, sync[e].phase) for e in (a, b)] == [
        (0, gpb.SYNC_PHASE_LOADED),
        (0, gpb.SYNC_PHASE_LOADED),
    ]
    # a long poll that already knows target 1 answers at once with the new plan (wait_s
    # 60 s would hold it for the whole heartbeat interval otherwise)
    t0 = time.monotonic()
    beat = state.heartbeat(_beat(a, wait_s=60.0, known_target=1))
    assert beat.sync.params["group"] == "2" and time.monotonic() - t0 < 3.0
    published = state.events.events("published")
    assert [(e["version"], e["replan"]) for e in published] == [(1, False), (1, True)]
    _ack(state, a, 1, gpb.SYNC_PHASE_LOADED)
    assert state.events.events("loaded")[-1] == {
        "t": 1000.0, "event": "loaded", "engine": a, "version": 1, "current": 1,
    }  # fmt: skip


_DYING_ENGINE = """
import sys, time
from gateway.client import GatewayClient
from protos import gateway_pb2 as gpb
from gateway import messages as m
c = GatewayClient(sys.argv[1], sys.argv[2], margin_s=5.0)
spec = m.EngineSpec(backend="jax", model_family="llama", dtype="bfloat16", transports=("gloo",),
                    name="doomed")
reg = c.register_engine(spec)
lease = c.lease_prompts(reg.engine_id, 2, 5.0)
print(reg.engine_id, len(lease.prompts), flush=True)
while True:
    c.heartbeat(reg.engine_id, 2, 60.0, reg.sync.target_version if reg.sync else 0)
"""


def test_sigkill_during_the_heartbeat_long_poll_drops_the_engine_at_once(gw, tmp_path):
    # heartbeats every 40 s, timeout 120 s: only the broken long poll can drop it in this test
    cfg = GatewayConfig(
        settings=RunSettings(model_family="llama"), heartbeat_timeout_s=120.0, max_wait_s=60.0
    )
    srv = GatewayServer(cfg, gw.TOKENS, events_file=tmp_path / "events.jsonl").start()
    trainer = GatewayClient(srv.address, gw.TOKENS["trainer"], margin_s=5.0)
    engine = GatewayClient(srv.address, gw.TOKENS["engine"], margin_s=5.0)
    try:
        srv.state.submit(gpb.SubmitRequest(prompts=[gw.prompt(f"p{i}") for i in range(3)]))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
        proc = subprocess.Popen(
            [sys.executable, "-c", _DYING_ENGINE, srv.address, gw.TOKENS["engine"]],
            stdout=subprocess.PIPE, env=env, text=True,
        )  # fmt: skip
        engine_id, leased = proc.stdout.readline().split()
        assert int(leased) == 2
        while srv.state._engines[engine_id].in_calls == 0:  # its long poll is not in yet
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30.0  # << the 120 s heartbeat timeout
        while not srv.state.events.events("leases_requeued"):
            assert time.monotonic() < deadline, "the gateway did not notice the dead engine"
            time.sleep(0.05)
        dropped = srv.state.events.events("dropped")
        assert [e["engine"] for e in dropped] == [engine_id]
        assert "long poll was cancelled before the answer" in dropped[0]["reason"]
        requeued = srv.state.events.events("leases_requeued")
        assert [(e["leases"], e["prompts"]) for e in requeued] == [(1, 2)]
        rows = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert [r["event"] for r in rows] == ["registered", "leased", "dropped", "leases_requeued"]
        spec_id = engine.register_engine(_spec()).engine_id
        assert sorted(p.sample_id for p in engine.lease_prompts(spec_id, 5, 1.0).prompts) == [
            "p0", "p1", "p2",
        ]  # fmt: skip
        # a long poll answered by its own timeout is no broken connection
        engine.heartbeat(spec_id, 0, 0.2, 0)
        assert [e.engine_id for e in trainer.status().engines] == [spec_id]
    finally:
        trainer.close()
        engine.close()
        srv.stop(0)


def _spec():
    from gateway import messages as m

    return m.EngineSpec(
        backend="jax", model_family="llama", dtype="bfloat16", transports=("gloo",), name="ok"
    )


class _Ctx:
    def __init__(self, left):
        self.left = left

    def time_remaining(self):
        return self.left


def test_only_a_long_poll_cut_short_before_its_deadline_drops_the_engine(gw):
    import threading

    from gateway.auth import Authenticator
    from gateway.servicer import GatewayServicer

    state, _ = _state(gw)
    servicer = GatewayServicer(state, Authenticator(gw.TOKENS), lambda reason: None)
    eid = _register(state, gw.register(name="a")).engine_id
    answered = threading.Event()
    answered.set()
    request = _beat(eid)
    servicer._ended("Heartbeat", request, _Ctx(30.0), answered)  # answered: a normal end
    servicer._ended("Heartbeat", request, _Ctx(0.1), threading.Event())  # its deadline ran out
    forged = gpb.HeartbeatRequest(engine_id=eid, engine_key="another engine's key")
    servicer._ended("LeasePrompts", forged, _Ctx(12.0), threading.Event())  # not its call
    assert [e.engine_id for e in state.status().engines] == [eid]
    servicer._ended("LeasePrompts", request, _Ctx(12.0), threading.Event())  # cut short
    assert state.status().engines == []
    assert state.events.events("dropped")[0]["reason"] == (
        f"engine {eid!r}: its LeasePrompts long poll was cancelled before the answer (its "
        "connection dropped: the process died or closed its channel)"
    )
