"""GatewayState on a fake clock: lease order, expiry, late returns, back-pressure, versions."""

import time

import pytest

from gateway.config import GatewayConfig, RunSettings
from gateway.errors import GatewayError
from gateway.state import GatewayState
from gateway.status import format_status
from protos import gateway_pb2 as gpb
from protos import rollout_pb2 as rpb


def _state(gw, **kw):
    clock = gw.FakeClock()
    run = {k: kw.pop(k) for k in list(kw) if k in RunSettings.__dataclass_fields__}
    cfg = {"lease_seconds": 30.0, "heartbeat_timeout_s": 10.0, **kw}
    settings = RunSettings(**{"model_family": "llama", **run})
    return GatewayState(GatewayConfig(settings=settings, **cfg), clock=clock), clock


def _key(state, engine_id):
    """The engine_key RegisterEngine gave `engine_id` ("" once it is gone)."""
    engine = state._engines.get(engine_id)
    return engine.key if engine is not None else ""


def _lease(state, engine_id, n, timeout_s=0.0):
    return state.lease(
        gpb.LeaseRequest(
            engine_id=engine_id,
            engine_key=_key(state, engine_id),
            max_prompts=n,
            timeout_s=timeout_s,
        )
    )


def _submit(state, prompts):
    return state.submit(gpb.SubmitRequest(prompts=prompts))


def _ret(state, engine_id, lease_id, groups=(), released=()):
    return state.return_rollouts(
        gpb.ReturnRequest(
            engine_id=engine_id,
            engine_key=_key(state, engine_id),
            lease_id=lease_id,
            groups=groups,
            released_sample_ids=released,
        )
    )


def _fetch(state, n=100):
    return state.fetch(gpb.FetchRequest(max_groups=n, min_groups=0, timeout_s=0.0)).groups


def test_eval_prompts_lease_first_then_fifo(gw):
    state, _ = _state(gw)
    eid = state.register(gw.register()).engine_id
    _submit(state, [gw.prompt("t0"), gw.prompt("t1"), gw.prompt("e0", is_eval=True)])
    reply = _lease(state, eid, 2)
    assert [p.sample_id for p in reply.prompts] == ["e0", "t0"]
    assert reply.expires_in_s == 30.0
    assert [p.sample_id for p in _lease(state, eid, 5).prompts] == ["t1"]
    assert _lease(state, eid, 5).lease_id == ""


def test_expired_lease_returns_prompts_to_front_and_drops_late_groups(gw):
    state, clock = _state(gw)
    a = state.register(gw.register(name="a")).engine_id
    b = state.register(gw.register(name="b")).engine_id
    _submit(state, [gw.prompt(f"p{i}") for i in range(4)])
    first = _lease(state, a, 2)
    assert [p.sample_id for p in first.prompts] == ["p0", "p1"]
    for _ in range(4):  # 32 s: past the 30 s deadline; both engines keep heartbeating
        clock.t += 8.0
        for eid in (a, b):
            state.heartbeat(gpb.HeartbeatRequest(engine_id=eid, engine_key=_key(state, eid)))
    second = _lease(state, b, 3)
    assert [p.sample_id for p in second.prompts] == ["p0", "p1", "p2"]
    late = _ret(state, a, first.lease_id, [gw.group("p0")])
    assert (late.accepted, late.dropped) == (0, 1)
    assert "deadline" in late.dropped_reason
    ok = _ret(state, b, second.lease_id, [gw.group("p0"), gw.group("p1")], released=["p2"])
    assert (ok.accepted, ok.dropped, ok.released) == (2, 0, 1)
    assert [g.sample_id for g in _fetch(state)] == ["p0", "p1"]
    status = state.status()
    assert status.counters.groups_dropped_late == 1
    assert status.counters.leases_expired == 1
    assert (status.queues.pending_train, status.queues.leased_prompts) == (2, 0)


def test_silent_engine_is_dropped_and_its_prompts_go_back(gw):
    state, clock = _state(gw)
    a = state.register(gw.register(name="a")).engine_id
    b = state.register(gw.register(name="b")).engine_id
    _submit(state, [gw.prompt("p0"), gw.prompt("p1")])
    lease_a = _lease(state, a, 1)
    clock.t += 6.0
    state.heartbeat(gpb.HeartbeatRequest(engine_id=b, engine_key=_key(state, b)))
    clock.t += 6.0  # a silent for 12 s > 10 s; b for 6 s
    assert state.reap()
    assert [p.sample_id for p in _lease(state, b, 5).prompts] == ["p0", "p1"]
    with pytest.raises(GatewayError) as err:
        _ret(state, a, lease_a.lease_id, [gw.group("p0")])
    assert err.value.code == "NOT_FOUND"
    assert "missed heartbeats" in err.value.message
    assert state.status().counters.engines_lost == 1


def test_rollout_capacity_holds_engines_back_until_the_trainer_fetches(gw):
    state, _ = _state(gw, rollout_capacity=3)
    eid = state.register(gw.register()).engine_id
    _submit(state, [gw.prompt(f"p{i}") for i in range(5)])
    lease = _lease(state, eid, 10)
    assert len(lease.prompts) == 3
    full = _lease(state, eid, 10)
    assert (full.lease_id, full.backpressure) == ("", True)
    _ret(state, eid, lease.lease_id, [gw.group(p.sample_id) for p in lease.prompts])
    assert _lease(state, eid, 10).backpressure
    assert len(_fetch(state, 2)) == 2
    assert [p.sample_id for p in _lease(state, eid, 10).prompts] == ["p3", "p4"]


def test_min_version_keeps_stale_engines_off_fresh_prompts(gw):
    state, _ = _state(gw)
    eid = state.register(gw.register()).engine_id
    state.publish(gpb.PublishRequest(version=1))
    _submit(state, [gw.prompt("new", min_version=1)])
    assert _lease(state, eid, 1).lease_id == ""
    state.ack(
        gpb.AckRequest(
            engine_id=eid, engine_key=_key(state, eid), version=1, phase=gpb.SYNC_PHASE_LOADED
        )
    )
    assert [p.sample_id for p in _lease(state, eid, 1).prompts] == ["new"]


def test_sync_directive_acks_and_wait_sync(gw):
    state, _ = _state(gw)
    eid = state.register(gw.register()).engine_id
    assert not state.heartbeat(
        gpb.HeartbeatRequest(engine_id=eid, engine_key=_key(state, eid))
    ).sync.pending
    assert list(state.publish(gpb.PublishRequest(version=3, params={"port": "9"})).engine_ids) == [
        eid
    ]
    sync = state.heartbeat(gpb.HeartbeatRequest(engine_id=eid, engine_key=_key(state, eid))).sync
    assert (sync.pending, sync.target_version, dict(sync.params)) == (True, 3, {"port": "9"})
    ready = gpb.WaitSyncRequest(version=3, phase=gpb.SYNC_PHASE_READY, timeout_s=0.0)
    assert not state.wait_sync(ready).done
    state.ack(
        gpb.AckRequest(
            engine_id=eid, engine_key=_key(state, eid), version=3, phase=gpb.SYNC_PHASE_READY
        )
    )
    assert state.wait_sync(ready).done
    state.ack(
        gpb.AckRequest(
            engine_id=eid, engine_key=_key(state, eid), version=3, phase=gpb.SYNC_PHASE_LOADED
        )
    )
    loaded = state.wait_sync(gpb.WaitSyncRequest(version=3, phase=gpb.SYNC_PHASE_LOADED))
    assert loaded.done and loaded.engines[0].version == 3
    assert not state.heartbeat(
        gpb.HeartbeatRequest(engine_id=eid, engine_key=_key(state, eid))
    ).sync.pending
    late = state.register(gw.register(name="late"))
    assert (late.current_version, late.sync.pending, late.sync.target_version) == (3, True, 3)


def _ack(state, eid, version, phase, seq, error=""):
    return state.ack(
        gpb.AckRequest(
            engine_id=eid, engine_key=_key(state, eid), version=version, phase=phase,
            error=error, serving=phase == gpb.SYNC_PHASE_FAILED, seq=seq,
        )
    )  # fmt: skip


def test_an_ack_of_an_earlier_plan_of_the_version_is_ignored(gw, caplog):
    """An engine that registered while the plan of a dead group was current fails it (it is
    no member); its FAILED ack lands after the trainer re-planned the version: ignored (an
    event and a log line), never counted against the new plan; acks of the new plan count."""
    state, _ = _state(gw)
    state.register(gw.register(name="dead"))
    state.publish(gpb.PublishRequest(version=1, params={"group": "1"}))
    reborn = state.register(gw.register(name="reborn"))
    eid = reborn.engine_id
    assert (reborn.sync.target_version, dict(reborn.sync.params), reborn.sync.seq) == (
        1, {"group": "1"}, 1,
    )  # fmt: skip
    state.publish(gpb.PublishRequest(version=1, params={"group": "2"}))  # the re-plan
    beat = state.heartbeat(gpb.HeartbeatRequest(engine_id=eid, engine_key=_key(state, eid)))
    assert (dict(beat.sync.params), beat.sync.seq) == ({"group": "2"}, 2)
    error = "SyncPlanError: engine 'reborn-2' is not in the data-plane group of version 1"
    with caplog.at_level("WARNING", logger="gateway.versions"):
        reply = _ack(state, eid, 1, gpb.SYNC_PHASE_FAILED, seq=1, error=error)
    assert (reply.sync.target_version, reply.sync.seq) == (1, 2)
    (stale,) = state.events.events("stale_ack")
    assert {k: v for k, v in stale.items() if k != "t"} == {
        "event": "stale_ack", "engine": eid, "version": 1, "phase": "FAILED", "seq": 1,
        "current_seq": 2,
    }  # fmt: skip
    assert [r.getMessage() for r in caplog.records] == [
        f"ignored the FAILED ack of {eid} for version 1: it answers plan 1 of that version, "
        "the current plan is 2"
    ]
    assert state.events.events("sync_failed") == []
    loaded = gpb.WaitSyncRequest(version=1, phase=gpb.SYNC_PHASE_LOADED, timeout_s=0.0)
    mine = {s.engine_id: s for s in state.wait_sync(loaded).engines}[eid]
    assert (mine.version, mine.phase, mine.error) == (0, gpb.SYNC_PHASE_LOADED, "")
    _ack(state, eid, 1, gpb.SYNC_PHASE_READY, seq=1)  # a stale READY is ignored too
    ready = gpb.WaitSyncRequest(version=1, phase=gpb.SYNC_PHASE_READY, timeout_s=0.0)
    assert {s.engine_id: s for s in state.wait_sync(ready).engines}[eid].version == 0
    assert len(state.events.events("stale_ack")) == 2
    _ack(state, eid, 1, gpb.SYNC_PHASE_READY, seq=2)  # the new plan's acks count
    assert {s.engine_id: s for s in state.wait_sync(ready).engines}[eid].phase == (
        gpb.SYNC_PHASE_READY
    )
    _ack(state, eid, 1, gpb.SYNC_PHASE_FAILED, seq=2, error="TransferError: boom")
    assert [e["error"] for e in state.events.events("sync_failed")] == ["TransferError: boom"]
    _ack(state, eid, 1, gpb.SYNC_PHASE_LOADED, seq=1)  # loaded weights are loaded, any plan
    assert {s.engine_id: s for s in state.wait_sync(loaded).engines}[eid].version == 1
    assert len(state.events.events("stale_ack")) == 2


def _engine_text(state, eid):
    """The `vN (phase...)` part of the engine's line in the status text."""
    (line,) = [x for x in format_status(state.status()).splitlines() if x.startswith(f"  {eid} ")]
    return line[line.index("  v") + 2 : line.index(")  leased") + 1]


def _fail(state, eid, version, error, serving):
    return state.ack(
        gpb.AckRequest(
            engine_id=eid,
            engine_key=_key(state, eid),
            version=version,
            phase=gpb.SYNC_PHASE_FAILED,
            error=error,
            serving=serving,
        )
    )


def test_failed_sync_blocks_leasing_until_a_whole_version_loads(gw):
    state, _ = _state(gw)
    eid = state.register(gw.register()).engine_id
    _submit(state, [gw.prompt("p0")])
    state.publish(gpb.PublishRequest(version=1))
    _fail(state, eid, 1, "oom", serving=False)
    wait = state.wait_sync(gpb.WaitSyncRequest(version=1, phase=gpb.SYNC_PHASE_LOADED))
    assert not wait.done
    (e,) = wait.engines
    assert (e.version, e.phase, e.error, e.serving) == (1, gpb.SYNC_PHASE_FAILED, "oom", False)
    with pytest.raises(GatewayError) as err:
        _lease(state, eid, 1)
    assert err.value.code == "FAILED_PRECONDITION"
    assert err.value.message == (
        f"engine {eid!r} failed to load version 1 (oom) and holds no whole weight version; "
        "expected a LOADED acknowledgement before leasing"
    )
    # a READY for the next version does not make it whole: still no leases until LOADED
    state.publish(gpb.PublishRequest(version=2))
    state.ack(
        gpb.AckRequest(
            engine_id=eid, engine_key=_key(state, eid), version=2, phase=gpb.SYNC_PHASE_READY
        )
    )
    with pytest.raises(GatewayError) as err:
        _lease(state, eid, 1)
    assert err.value.message == (
        f"engine {eid!r} is syncing to version 2 after a failed load and holds no whole "
        "weight version; expected a LOADED acknowledgement before leasing"
    )
    state.ack(
        gpb.AckRequest(
            engine_id=eid, engine_key=_key(state, eid), version=2, phase=gpb.SYNC_PHASE_LOADED
        )
    )
    assert [p.sample_id for p in _lease(state, eid, 1).prompts] == ["p0"]
    (e,) = state.status().engines
    assert (e.weight_version, e.sync_version, e.sync_phase, e.serving) == (
        2,
        2,
        gpb.SYNC_PHASE_LOADED,
        True,
    )


def test_failed_sync_that_kept_the_old_version_keeps_serving_it(gw):
    state, _ = _state(gw)
    a = state.register(gw.register(name="a")).engine_id
    b = state.register(gw.register(name="b")).engine_id
    state.publish(gpb.PublishRequest(version=1))
    _submit(state, [gw.prompt("old"), gw.prompt("fresh", min_version=1)])
    state.ack(
        gpb.AckRequest(
            engine_id=a, engine_key=_key(state, a), version=1, phase=gpb.SYNC_PHASE_READY
        )
    )
    reply = _fail(state, a, 1, "ManifestError: refused", serving=True)
    assert (reply.sync.pending, reply.sync.target_version) == (True, 1)
    # the trainer's wait ends with the failure at once, though b has not loaded version 1
    t0 = time.monotonic()
    wait = state.wait_sync(
        gpb.WaitSyncRequest(version=1, phase=gpb.SYNC_PHASE_LOADED, timeout_s=30.0)
    )
    assert time.monotonic() - t0 < 5.0
    assert not wait.done
    states = {e.engine_id: (e.version, e.phase, e.error, e.serving) for e in wait.engines}
    assert states == {
        a: (1, gpb.SYNC_PHASE_FAILED, "ManifestError: refused", True),
        b: (0, gpb.SYNC_PHASE_LOADED, "", True),
    }
    # a still serves version 0: it leases what version 0 may serve, and stops at the front
    # prompt that needs version 1 (the queue's usual min_version check)
    lease = _lease(state, a, 5)
    assert [p.sample_id for p in lease.prompts] == ["old"]
    assert (lease.sync.pending, lease.sync.target_version) == (True, 1)
    ok = _ret(state, a, lease.lease_id, [gw.group("old", version=0)])
    assert (ok.accepted, ok.dropped) == (1, 0)
    (group,) = _fetch(state)
    assert group.sample_id == "old" and group.engine_id == a
    assert [(c.version_start, c.version_end) for c in group.completions] == [(0, 0), (0, 0)]
    (status_a, _) = state.status().engines
    assert (status_a.engine_id, status_a.weight_version, status_a.sync_version) == (a, 0, 1)
    assert (status_a.sync_phase, status_a.sync_error, status_a.serving) == (
        gpb.SYNC_PHASE_FAILED,
        "ManifestError: refused",
        True,
    )
    assert _engine_text(state, a) == "v0 (FAILED v1: ManifestError: refused; serving v0)"
    assert _engine_text(state, b) == "v0 (loaded)"
    # a later failure that leaves no whole version stops its leases
    state.publish(gpb.PublishRequest(version=2))
    _fail(state, a, 2, "RuntimeError: bucket 3", serving=False)
    with pytest.raises(GatewayError) as err:
        _lease(state, a, 1)
    assert err.value.code == "FAILED_PRECONDITION" and "bucket 3" in err.value.message
    assert _engine_text(state, a) == "v0 (FAILED v2: RuntimeError: bucket 3; NOT SERVING)"
    assert [p.sample_id for p in _lease(state, b, 5).prompts] == []  # fresh needs version 1


def test_serving_is_refused_outside_a_failed_ack(gw):
    state, _ = _state(gw)
    eid = state.register(gw.register()).engine_id
    state.publish(gpb.PublishRequest(version=1))
    for phase, name in ((gpb.SYNC_PHASE_READY, "READY"), (gpb.SYNC_PHASE_LOADED, "LOADED")):
        with pytest.raises(GatewayError) as err:
            state.ack(
                gpb.AckRequest(
                    engine_id=eid, engine_key=_key(state, eid), version=1, phase=phase, serving=True
                )
            )
        assert err.value.code == "INVALID_ARGUMENT"
        assert err.value.message == (
            f"serving: expected false unless phase is FAILED, got true with phase SYNC_PHASE_{name}"
        )
    (e,) = state.status().engines
    assert (e.weight_version, e.sync_version, e.sync_phase) == (0, 0, gpb.SYNC_PHASE_LOADED)


def test_deregister_returns_leased_prompts(gw):
    state, _ = _state(gw)
    eid = state.register(gw.register()).engine_id
    _submit(state, [gw.prompt("p0"), gw.prompt("p1")])
    _lease(state, eid, 2)
    assert (
        state.deregister(
            gpb.DeregisterRequest(engine_id=eid, engine_key=_key(state, eid))
        ).returned_prompts
        == 2
    )
    assert state.status().queues.pending_train == 2


def test_the_trainer_drops_an_engine_without_its_key_an_engine_needs_it(gw):
    """`deregister(by_trainer=True)` (the trainer's token: the launcher saw the engine's
    process exit) takes no key and requeues its leases; an engine's call still needs the key;
    an engine already gone is NOT_FOUND."""
    state, _ = _state(gw)
    eid = state.register(gw.register()).engine_id
    _submit(state, [gw.prompt("p0"), gw.prompt("p1")])
    _lease(state, eid, 2)
    with pytest.raises(GatewayError) as err:
        state.deregister(gpb.DeregisterRequest(engine_id=eid, engine_key="wrong"))
    assert err.value.code == "PERMISSION_DENIED"
    reply = state.deregister(gpb.DeregisterRequest(engine_id=eid), by_trainer=True)
    assert reply.returned_prompts == 2 and state.status().queues.pending_train == 2
    (dropped,) = state.events.events("dropped")
    assert dropped["reason"] == f"engine {eid!r} deregistered by the trainer (it exited)"
    with pytest.raises(GatewayError) as err:
        state.deregister(gpb.DeregisterRequest(engine_id=eid), by_trainer=True)
    assert err.value.code == "NOT_FOUND" and "not registered" in err.value.message


def test_configure_cannot_change_family_under_registered_engines(gw):
    state, _ = _state(gw)
    state.register(gw.register())
    with pytest.raises(GatewayError) as err:
        state.configure(gpb.RunSettings(model_family="qwen2"))
    assert err.value.code == "FAILED_PRECONDITION"
    assert "expected 'llama'" in err.value.message and "got 'qwen2'" in err.value.message
    assert state.configure(gpb.RunSettings(model_family="llama", rendezvous_address="h:1"))


def test_a_sample_id_in_flight_cannot_be_submitted_again_until_fetched(gw):
    state, _ = _state(gw)
    eid = state.register(gw.register()).engine_id
    _submit(state, [gw.prompt("p0")])
    with pytest.raises(GatewayError) as err:
        _submit(state, [gw.prompt("p0")])
    assert err.value.code == "ALREADY_EXISTS"
    lease = _lease(state, eid, 1)
    _ret(state, eid, lease.lease_id, [gw.group("p0")])
    assert len(_fetch(state)) == 1
    assert _submit(state, [gw.prompt("p0")]).accepted == 1


def test_registration_negotiation(gw):
    state, _ = _state(gw, dtype="bfloat16", transport="gloo", backends=("vllm", "jax"))
    ok = state.register(gw.register())
    assert ok.accepted and ok.settings.mapping == "llama" and ok.settings.transport == "gloo"
    cases = {
        "model family differs: the trainer's model is 'llama', the engine serves 'qwen2'": dict(
            model_family="qwen2"
        ),
        "dtype differs: the run uses 'bfloat16', the engine serves 'float32'": dict(
            dtype="float32"
        ),
        "backend not allowed": dict(backend="sglang"),
        "transport unsupported: the run moves weights over 'gloo'": dict(transports=["nccl"]),
    }
    for reason, change in cases.items():
        req = gw.register()
        for k, v in change.items():
            if k == "transports":
                del req.transports[:]
                req.transports.extend(v)
            else:
                setattr(req, k, v)
        reply = state.register(req)
        assert not reply.accepted and reply.refusal_reason.startswith(reason), reply
        assert not reply.retry


def test_an_adapter_only_run_takes_only_engines_of_its_adapter(gw):
    """sync.lora_only: an engine started without LoRA, or with another rank or targets, is
    refused at registration (not at its first push); one of the run's adapter is taken."""
    key = "lora r=8 targets=k_proj,q_proj"
    state, _ = _state(gw, adapter=key)
    assert state.register(gw.register(adapter=key)).accepted
    for engine, says in [
        ("", "full-weight versions only (started without LoRA)"),
        ("lora r=4 targets=k_proj,q_proj", "adapter-only versions of 'lora r=4"),
    ]:
        reply = state.register(gw.register(adapter=engine))
        assert not reply.accepted and not reply.retry
        assert reply.refusal_reason.startswith(
            f"adapter differs: the run pushes adapter-only versions of '{key}', the engine "
            f"takes {says}"
        ), reply.refusal_reason
    plain, _ = _state(gw)
    reply = plain.register(gw.register(adapter=key))
    assert "the run pushes full-weight versions" in reply.refusal_reason


def test_a_prompt_released_max_prompt_releases_times_becomes_an_aborted_group(gw):
    """A prompt that fails every engine (each releases it) would circle the queue forever and
    stall the run; after `max_prompt_releases` releases the trainer gets an aborted group in
    its place (G empty completions, finish reason "abort", at the current version), exactly
    once, and the prompts behind it are served as before."""
    state, _ = _state(gw, max_prompt_releases=3)
    a = state.register(gw.register(name="a")).engine_id
    b = state.register(gw.register(name="b")).engine_id
    _submit(state, [gw.prompt("bad", g=4), gw.prompt("ok")])
    fetched = []
    for i in range(3):
        lease = _lease(state, (a, b)[i % 2], 1)
        assert [p.sample_id for p in lease.prompts] == ["bad"]  # back at the front each time
        out = _ret(state, (a, b)[i % 2], lease.lease_id, released=["bad"])
        assert out.released == 1
        fetched.append([(g.sample_id, len(g.completions)) for g in _fetch(state)])
    assert fetched == [[], [], [("bad", 4)]]
    status = state.status()
    assert status.counters.prompts_released == 3 and status.counters.prompts_abandoned == 1
    assert (status.queues.pending_train, status.queues.leased_prompts) == (1, 0)
    lease = _lease(state, a, 5)
    assert [p.sample_id for p in lease.prompts] == ["ok"]
    _ret(state, a, lease.lease_id, [gw.group("ok")])
    assert [g.sample_id for g in _fetch(state)] == ["ok"]
    assert state.events.events("prompt_abandoned")[0]["sample_id"] == "bad"


def test_the_aborted_group_of_an_abandoned_prompt_is_fetched_once(gw):
    state, _ = _state(gw, max_prompt_releases=1)
    a = state.register(gw.register()).engine_id
    _submit(state, [gw.prompt("bad", g=2)])
    lease = _lease(state, a, 1)
    _ret(state, a, lease.lease_id, released=["bad"])
    (group,) = _fetch(state)
    assert (group.sample_id, group.engine_id, group.prompt.sample_id) == ("bad", a, "bad")
    assert [c.finish_reason for c in group.completions] == [rpb.FINISH_REASON_ABORT] * 2
    assert all(len(c.token_ids) == 0 for c in group.completions)
    assert len(_fetch(state)) == 0
    assert not state.queue.in_flight("bad")
    with pytest.raises(ValueError, match="max_prompt_releases: expected >= 1"):
        GatewayConfig(max_prompt_releases=0)


def test_memory_of_dropped_engines_and_of_rates_stays_bounded(gw, monkeypatch):
    """A long run drops and re-registers engines and returns groups without anyone asking
    for the status: what the gateway remembers of both stays bounded."""
    import gateway.state as gateway_state

    monkeypatch.setattr(gateway_state, "_REMEMBERED_LOST", 3)
    state, _ = _state(gw)
    ids = []
    for i in range(5):
        eid = state.register(gw.register(name=f"e{i}")).engine_id
        state.deregister(gpb.DeregisterRequest(engine_id=eid, engine_key=_key(state, eid)))
        ids.append(eid)
    assert list(state._lost) == ids[2:]
    with pytest.raises(GatewayError, match="never registered"):  # forgotten
        _lease(state, ids[0], 1)
    with pytest.raises(GatewayError, match="missed heartbeats or left"):
        _lease(state, ids[4], 1)

    now = [1000.0]
    monkeypatch.setattr(gateway_state.time, "monotonic", lambda: now[0])
    eid = state.register(gw.register(name="r")).engine_id
    _submit(state, [gw.prompt(f"p{i}") for i in range(3)])
    for i in range(3):
        lease = _lease(state, eid, 1)
        _ret(state, eid, lease.lease_id, [gw.group(f"p{i}")])
        now[0] += 45.0  # past the 60 s window after two returns
    assert len(state._rates) == 2  # the first return left the window, with no status call
