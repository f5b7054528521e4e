"""Bad input gets a status naming what was expected and what came; the server keeps serving."""

import dataclasses

import numpy as np
import pytest

from gateway import messages as m
from gateway.client import GatewayClient
from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.server import GatewayServer

SPEC = m.EngineSpec(backend="jax", model_family="llama", dtype="bf16", transports=("gloo",))


def _prompt(sid="p", tokens=(1, 2, 3), g=2, **sampling):
    params = dict(max_new_tokens=4)
    params.update(sampling)
    return m.Prompt(sid, np.array(tokens, np.int32), g, m.SamplingParams(**params))


def _completion(n=2, lps=None, reason="stop", v0=0, v1=0):
    lps = np.full(n, -0.5, np.float32) if lps is None else np.array(lps, np.float32)
    return m.Completion(np.arange(n, dtype=np.int32), lps, reason, v0, v1)


def _error(call):
    with pytest.raises(GatewayError) as err:
        call()
    return err.value.code, err.value.message


def _still_serving(server, version=0):
    status = server.trainer.status()
    assert not status.shutting_down and status.current_version == version


def test_bad_prompts(server):
    t = server.trainer
    cases = [
        (_prompt(g=0), "expected group size 1..1024, got 0"),
        (_prompt(tokens=()), "expected 1..1048576 prompt tokens, got 0"),
        (_prompt(sid=""), "sample_id: expected a non-empty id, got ''"),
        (_prompt(tokens=(1, -3)), "expected token ids >= 0, got -3"),
        (_prompt(top_p=0.0), "expected 0 < top_p <= 1, got 0.0"),
        (_prompt(temperature=float("nan")), "expected temperature >= 0, got nan"),
        (_prompt(max_new_tokens=0), "expected max_new_tokens 1..1048576, got 0"),
        (_prompt(top_k=-1), "expected top_k >= 0 (0: no cut), got -1"),
    ]
    for bad, message in cases:
        code, msg = _error(lambda b=bad: t.submit_prompts([_prompt("ok"), b]))
        assert code == "INVALID_ARGUMENT" and message in msg, (message, msg)
    assert _error(lambda: t.submit_prompts([_prompt("a"), _prompt("a")]))[0] == "ALREADY_EXISTS"
    assert _error(lambda: t.submit_prompts([], timeout_s=-1))[1] == (
        "timeout_s: expected a finite number of seconds >= 0, got -1.0"
    )
    assert server.trainer.status().counters.prompts_submitted == 0  # all or none
    _still_serving(server)


def test_unknown_engine_and_lease(server):
    e = server.engine
    code, msg = _error(lambda: e.lease_prompts("ghost-9", 1, 0.0))
    assert code == "NOT_FOUND"
    assert msg == "engine id 'ghost-9': expected a registered engine, got an unknown one " + (
        "(never registered)"
    )
    reg = e.register_engine(SPEC)
    code, msg = _error(lambda: e.return_rollouts(reg.engine_id, "L-nope", []))
    assert code == "NOT_FOUND" and "expected a lease the gateway granted" in msg
    assert _error(lambda: e.lease_prompts(reg.engine_id, 0, 0.0))[1] == (
        "max_prompts: expected >= 1, got 0"
    )
    _still_serving(server)


def test_bad_groups_change_nothing(server):
    t, e = server.trainer, server.engine
    reg = e.register_engine(SPEC)
    t.submit_prompts([_prompt("p0"), _prompt("p1")])
    lease = e.lease_prompts(reg.engine_id, 2, 1.0)
    good = m.RolloutGroup("p0", (_completion(), _completion()))
    cases = [
        (m.RolloutGroup("p1", (_completion(),)), "expected 2 completions (the group size), got 1"),
        (m.RolloutGroup("p1", (_completion(), _completion(lps=[-1.0]))), "expected one log-prob"),
        (m.RolloutGroup("p1", (_completion(), _completion(n=5))), "at most max_new_tokens=4"),
        (m.RolloutGroup("p1", (_completion(), _completion(lps=[0.5, -1]))), "log-probs <= 0"),
        (m.RolloutGroup("p1", (_completion(), _completion(v1=3))), "<= 0 (the current version)"),
        (
            m.RolloutGroup(
                "p1", (_completion(), dataclasses.replace(_completion(), forced_positions=(1, 1)))
            ),
            "expected forced_positions ascending, unique and in [0, 2)",
        ),
        (
            m.RolloutGroup(
                "p1", (_completion(), dataclasses.replace(_completion(), forced_positions=(2,)))
            ),
            "expected forced_positions ascending, unique and in [0, 2)",
        ),
        (
            m.RolloutGroup(
                "p1", (_completion(), dataclasses.replace(_completion(), turns=2, observations=2))
            ),
            "expected turns >= 0 and 0 <= observations < turns, got 2 turns and 2 observations",
        ),
        (
            m.RolloutGroup(
                "p1", (_completion(), dataclasses.replace(_completion(), env_reward=float("nan")))
            ),
            "expected a finite env_reward, got nan",
        ),
        (m.RolloutGroup("zz", (_completion(), _completion())), "got one outside it"),
        (good, "expected once per return, got it twice"),
    ]
    for bad, message in cases:
        code, msg = _error(
            lambda b=bad: e.return_rollouts(reg.engine_id, lease.lease_id, [good, b])
        )
        assert code == "INVALID_ARGUMENT" and message in msg, (message, msg)
    assert t.status().queues.ready_groups == 0 and t.status().queues.leased_prompts == 2
    ok = e.return_rollouts(reg.engine_id, lease.lease_id, [good], ["p1"])
    assert (ok.accepted, ok.released) == (1, 1)
    _still_serving(server)


def test_versions_must_increase_and_acks_must_name_published_versions(server):
    t, e = server.trainer, server.engine
    reg = e.register_engine(SPEC)
    t.publish_version(2)
    assert _error(lambda: t.publish_version(2)) == (
        "INVALID_ARGUMENT",
        "version: expected > 2 (versions only increase), got 2",
    )
    assert _error(lambda: t.publish_version(1))[1].endswith("got 1")
    assert _error(lambda: e.ack_version(reg.engine_id, 5)) == (
        "INVALID_ARGUMENT",
        "version: expected a published version 0..2, got 5 (never published)",
    )
    e.ack_version(reg.engine_id, 2)
    assert _error(lambda: e.ack_version(reg.engine_id, 1))[1] == (
        "version: expected >= 2 (the engine's loaded version), got 1"
    )
    assert _error(lambda: t.fetch_rollouts(1, 0.0, min_groups=3))[1] == (
        "min_groups: expected 0..max_groups=1, got 3"
    )
    _still_serving(server, version=2)


def test_malformed_registration_is_invalid(server):
    e = server.engine
    cases = [
        (dict(tp_size=3, device_count=4), "tp_size: expected >= 1 and dividing device_count=4"),
        (dict(device_count=0), "device_count: expected >= 1, got 0"),
        (dict(transports=()), "transports: expected non-empty names, got []"),
        (dict(weight_version=4), "weight_version: expected 0..0 (the current version), got 4"),
        (dict(backend=""), "backend: expected a non-empty id"),
    ]
    for change, message in cases:
        spec = m.EngineSpec(**{**SPEC.__dict__, **change})
        code, msg = _error(lambda s=spec: e.register_engine(s))
        assert code == "INVALID_ARGUMENT" and message in msg, (message, msg)
    _still_serving(server)


def test_oversize_message_is_refused_and_the_server_keeps_serving():
    tokens = {"trainer": "t" * 20, "engine": "e" * 20}
    srv = GatewayServer(GatewayConfig(max_message_bytes=1 << 20), tokens).start()
    try:
        with GatewayClient(srv.address, tokens["trainer"]) as t:
            huge = _prompt("big", tokens=np.full(400_000, 100_000, np.int32))  # ~1.2 MB
            code, msg = _error(lambda: t.submit_prompts([huge]))
            assert code == "RESOURCE_EXHAUSTED" and "1048576" in msg
            assert t.submit_prompts([_prompt("small")]) == 1
            assert t.status().queues.pending_train == 1
    finally:
        srv.stop(0)
