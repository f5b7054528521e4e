"""Only calls carrying an engine's own engine_key keep it alive: not another engine's calls
(the engine token is shared), not the trainer's, not a metrics report without the key."""

import pytest

from gateway import messages as m
from gateway.client import GatewayClient
from gateway.errors import GatewayError

from .conftest import TOKENS

SPEC = m.EngineSpec(backend="jax", model_family="llama", dtype="bf16", transports=("gloo",))


def _refused(call):
    with pytest.raises(GatewayError) as err:
        call()
    return err.value.code, err.value.message


def test_another_engine_cannot_refresh_or_act_for_an_engine(server):
    a = server.engine.register_engine(m.EngineSpec("jax", "llama", "bf16", ("gloo",), name="a"))
    with GatewayClient(server.server.address, TOKENS["engine"], margin_s=5.0) as other:
        b = other.register_engine(m.EngineSpec("jax", "llama", "bf16", ("gloo",), name="b"))
        assert len(a.engine_key) == 32 and a.engine_key != b.engine_key
        server.clock.t += 6.0  # of a 10 s heartbeat timeout
        for call in (
            lambda: other.heartbeat(a.engine_id),
            lambda: other.lease_prompts(a.engine_id, 1, 1.0),
            lambda: other.ack_version(a.engine_id, 0, "ready"),
            lambda: other.return_rollouts(a.engine_id, "L-x", []),
            lambda: other.deregister(a.engine_id),
        ):
            code, msg = _refused(call)
            assert code == "PERMISSION_DENIED"
            assert msg == (
                "engine id 'a-1': expected the engine_key its registration returned, got none"
            )
        other.adopt_engine(a.engine_id, b.engine_key)
        assert _refused(lambda: other.heartbeat(a.engine_id))[1].endswith("got another key")
        # neither the trainer's report nor one without the key counts as a heartbeat
        server.trainer.report_metrics(a.engine_id, 1, {"x": 1.0})
        other.report_metrics(a.engine_id, 1, {"x": 2.0})
        other.heartbeat(b.engine_id)  # b's own heartbeat, with its key
        assert server.state._engines[a.engine_id].last_seen == 1000.0
        server.clock.t += 5.0  # a silent for 11 s, b for 5 s
        status = server.trainer.status()
        assert [e.engine_id for e in status.engines] == [b.engine_id]
        assert status.counters.engines_lost == 1
        assert _refused(lambda: server.engine.heartbeat(a.engine_id))[0] == "NOT_FOUND"


def test_an_engines_own_calls_and_keyed_reports_keep_it_alive(server):
    reg = server.engine.register_engine(SPEC)
    server.clock.t += 8.0
    server.engine.report_metrics(reg.engine_id, 1, {"tokens_per_s": 5.0})  # carries the key
    server.clock.t += 8.0
    with GatewayClient(server.server.address, TOKENS["engine"], margin_s=5.0) as second:
        second.adopt_engine(reg.engine_id, reg.engine_key)  # e.g. a second channel of the engine
        second.heartbeat(reg.engine_id)
    server.clock.t += 8.0
    status = server.trainer.status()
    assert [e.engine_id for e in status.engines] == [reg.engine_id]
    assert status.engines[0].last_seen_s == 8.0 and status.counters.engines_lost == 0


def test_a_long_poll_for_another_engine_no_longer_pins_it(server):
    """A waiting call used to keep its engine from being reaped (in_calls); a poll without the
    key is refused before it waits."""
    a = server.engine.register_engine(SPEC)
    with GatewayClient(server.server.address, TOKENS["engine"], margin_s=5.0) as other:
        assert _refused(lambda: other.lease_prompts(a.engine_id, 1, 3.0))[0] == (
            "PERMISSION_DENIED"
        )
    assert server.state._engines[a.engine_id].in_calls == 0
    server.clock.t += 11.0
    assert server.trainer.status().counters.engines_lost == 1
