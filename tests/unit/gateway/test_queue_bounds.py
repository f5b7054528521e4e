"""GatewayState bounds: min_version within reach, no head-of-line blocking, replies under
the byte budget, metric sources evicted oldest first, engines capped, status bounded."""

import pytest

from gateway.config import GatewayConfig, RunSettings
from gateway.errors import GatewayError
from gateway.state import GatewayState
from protos import gateway_pb2 as gpb
from protos import rollout_pb2 as rpb


def _state(gw, **kw):
    run = {k: kw.pop(k) for k in list(kw) if k in RunSettings.__dataclass_fields__}
    cfg = {"lease_seconds": 30.0, "heartbeat_timeout_s": 10.0, **kw}
    settings = RunSettings(**{"model_family": "llama", **run})
    return GatewayState(GatewayConfig(settings=settings, **cfg), clock=gw.FakeClock())


def _engine(state, gw, name="e"):
    reply = state.register(gw.register(name=name))
    return reply.engine_id, reply.engine_key


def _lease(state, eid, key, n):
    req = gpb.LeaseRequest(engine_id=eid, engine_key=key, max_prompts=n, timeout_s=0.0)
    return state.lease(req)


def _refusal(call):
    with pytest.raises(GatewayError) as err:
        call()
    return err.value.code, err.value.message


def test_min_version_beyond_reach_is_refused_and_nothing_is_queued(gw):
    state = _state(gw)
    ok, far = gw.prompt("ok", min_version=1), gw.prompt("far", min_version=2)
    code, msg = _refusal(lambda: state.submit(gpb.SubmitRequest(prompts=[ok, far])))
    assert code == "INVALID_ARGUMENT"
    assert msg == (
        "prompt 'far': expected min_version <= 1 (the current version 0 + "
        "min_version_ahead 1), got 2"
    )
    assert state.queue.pending(False) == 0  # all or none
    state.publish(gpb.PublishRequest(version=5))
    assert state.submit(gpb.SubmitRequest(prompts=[far, gw.prompt("v6", min_version=6)])).accepted
    strict = _state(gw, min_version_ahead=0)
    code, msg = _refusal(lambda: strict.submit(gpb.SubmitRequest(prompts=[ok])))
    assert "expected min_version <= 0 (the current version 0 + min_version_ahead 0), got 1" in msg


def test_a_prompt_waiting_for_a_newer_version_does_not_block_those_behind_it(gw):
    state = _state(gw)
    eid, key = _engine(state, gw)
    prompts = [gw.prompt("next", min_version=1), gw.prompt("a"), gw.prompt("b")]
    prompts += [gw.prompt("ev-next", is_eval=True, min_version=1), gw.prompt("ev", is_eval=True)]
    state.submit(gpb.SubmitRequest(prompts=prompts))
    first = _lease(state, eid, key, 10)
    assert [p.sample_id for p in first.prompts] == ["ev", "a", "b"]
    assert _lease(state, eid, key, 10).lease_id == ""  # only version-1 prompts are left
    assert (state.queue.pending(True), state.queue.pending(False)) == (1, 1)
    state.publish(gpb.PublishRequest(version=1))
    state.ack(gpb.AckRequest(engine_id=eid, engine_key=key, version=1, phase=2))
    assert [p.sample_id for p in _lease(state, eid, key, 10).prompts] == ["ev-next", "next"]


def test_requeued_prompts_keep_their_place_across_versions(gw):
    state = _state(gw)
    eid, key = _engine(state, gw)
    state.publish(gpb.PublishRequest(version=1))
    state.ack(gpb.AckRequest(engine_id=eid, engine_key=key, version=1, phase=2))
    ids = ["p0", "p1", "p2", "p3"]
    state.submit(
        gpb.SubmitRequest(prompts=[gw.prompt(s, min_version=i % 2) for i, s in enumerate(ids)])
    )
    lease = _lease(state, eid, key, 2)
    assert [p.sample_id for p in lease.prompts] == ["p0", "p1"]
    state.return_rollouts(
        gpb.ReturnRequest(
            engine_id=eid, engine_key=key, lease_id=lease.lease_id, released_sample_ids=["p0", "p1"]
        )
    )
    assert [p.sample_id for p in _lease(state, eid, key, 4).prompts] == ids


def test_lease_and_fetch_replies_stay_under_half_the_largest_message(gw):
    state = _state(gw, max_message_bytes=1 << 20, rollout_capacity=64)
    eid, key = _engine(state, gw)
    big = [
        rpb.Prompt(
            sample_id=f"b{i}",
            token_ids=[100_000] * 50_000,  # 3 bytes each as a varint: ~150 KB per prompt
            group_size=1,
            sampling=rpb.SamplingParams(top_p=1.0, max_new_tokens=40_000),
        )
        for i in range(8)
    ]
    size = big[0].ByteSize()
    assert 150_000 < size < 151_000
    state.submit(gpb.SubmitRequest(prompts=big))
    budget = (1 << 20) // 2
    lease = _lease(state, eid, key, 8)
    assert len(lease.prompts) == budget // size == 3
    groups = []
    for p in lease.prompts:
        c = rpb.Completion(
            token_ids=[7] * 30_000, logprobs=[-0.5] * 30_000, finish_reason=1
        )  # ~150 KB with the stamped prompt
        groups.append(rpb.RolloutGroup(sample_id=p.sample_id, completions=[c]))
    state.return_rollouts(
        gpb.ReturnRequest(engine_id=eid, engine_key=key, lease_id=lease.lease_id, groups=groups)
    )
    fetched = state.fetch(gpb.FetchRequest(max_groups=8, timeout_s=0.0)).groups
    stamped = fetched[0].ByteSize()
    assert len(fetched) == budget // stamped == 1  # each ~300 KB with its prompt stamped in
    assert len(state.fetch(gpb.FetchRequest(max_groups=8, timeout_s=0.0)).groups) == 1


def test_a_group_too_large_to_deliver_is_refused_at_return(gw):
    state = _state(gw, max_message_bytes=1 << 20)
    eid, key = _engine(state, gw)
    p = rpb.Prompt(
        sample_id="p",
        token_ids=[1],
        group_size=1,
        sampling=rpb.SamplingParams(top_p=1.0, max_new_tokens=1 << 20),
    )
    state.submit(gpb.SubmitRequest(prompts=[p]))
    lease = _lease(state, eid, key, 1)
    c = rpb.Completion(token_ids=[7] * 120_000, logprobs=[-0.5] * 120_000, finish_reason=2)
    req = gpb.ReturnRequest(
        engine_id=eid,
        engine_key=key,
        lease_id=lease.lease_id,
        groups=[rpb.RolloutGroup(sample_id="p", completions=[c])],
    )
    code, msg = _refusal(lambda: state.return_rollouts(req))
    assert code == "INVALID_ARGUMENT" and msg.startswith(
        "group 'p': expected at most 524288 bytes with its prompt (half the largest message), got "
    )
    assert state.queue.leased_prompts == 1 and state.queue.ready == 0  # nothing changed


def test_metric_sources_beyond_the_cap_evict_the_oldest(gw):
    state = _state(gw, max_metric_sources=3)
    for name in ("a", "b", "c", "d"):
        state.report_metrics(gpb.MetricsRequest(source=name, step=1, values={"x": 1.0}))
    state.report_metrics(gpb.MetricsRequest(source="b", step=2))  # b becomes the newest
    state.report_metrics(gpb.MetricsRequest(source="e", step=1))
    assert [(r.source, r.step) for r in state.status().metrics] == [("b", 2), ("d", 1), ("e", 1)]


def test_engines_beyond_max_engines_are_refused(gw):
    state = _state(gw, max_engines=2)
    _engine(state, gw, "a"), _engine(state, gw, "b")
    code, msg = _refusal(lambda: state.register(gw.register(name="c")))
    assert code == "RESOURCE_EXHAUSTED"
    assert msg == "engines: expected at most max_engines=2 registered at once, got one more"


def test_status_at_every_bound_stays_under_a_quarter_of_the_largest_message(gw):
    cfg = GatewayConfig(settings=RunSettings(model_family="llama"))
    state = GatewayState(cfg, clock=gw.FakeClock())
    names = cfg.max_name_chars
    for i in range(cfg.max_engines):
        req = gw.register(name=f"{i:04d}" + "n" * (names - 4))
        req.host, req.backend = "h" * names, "jax"
        reply = state.register(req)
        engine = state._engines[reply.engine_id]
        engine.sync_error = "e" * cfg.max_text_chars  # as a FAILED ack may leave it
    assert len(state._engines) == cfg.max_engines
    for s in range(cfg.max_metric_sources + 10):
        values = {f"{k:04d}" + "k" * (names - 4): float(k) for k in range(cfg.max_metric_keys)}
        state.report_metrics(
            gpb.MetricsRequest(source=f"{s:04d}" + "s" * (names - 4), values=values)
        )
    status = state.status()
    assert len(status.engines) == 1024 and len(status.metrics) == cfg.max_metric_sources
    print("status bytes at every bound:", status.ByteSize())
    assert status.ByteSize() < cfg.max_message_bytes // 4, status.ByteSize()
