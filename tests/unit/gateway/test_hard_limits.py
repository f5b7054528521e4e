"""Issue 25 item 2, through a real gateway server on 127.0.0.1: PublishVersion's params and
version have bounds the refusal names, request bytes that do not parse are INVALID_ARGUMENT
(not INTERNAL), and the trainer's deregistration of an engine (intended, without the engine's
key) is an event naming the caller's role. Each refusal leaves the server serving."""

from __future__ import annotations

import grpc
import pytest

from gateway import messages as m
from gateway.auth import METADATA_KEY
from gateway.config import GatewayConfig, RunSettings
from gateway.errors import GatewayError
from gateway.versions import MAX_VERSION

from .conftest import TOKENS, start_server

SPEC = m.EngineSpec(backend="jax", model_family="llama", dtype="bf16", transports=("gloo",))


@pytest.fixture
def run():
    r = start_server(GatewayConfig(settings=RunSettings(model_family="llama")))
    yield r
    r.trainer.close()
    r.engine.close()
    r.server.stop(0)


def _refusal(call) -> tuple[str, str]:
    with pytest.raises(GatewayError) as err:
        call()
    return err.value.code, err.value.message


def test_a_10_mb_param_value_is_refused_naming_the_bound(run):
    value = "x" * (10 * 1024 * 1024)
    code, message = _refusal(lambda: run.trainer.publish_version(1, {"manifest": value}))
    assert (code, message) == (
        "INVALID_ARGUMENT",
        "PublishRequest.params (keys and values, the gateway's max_param_bytes): expected at "
        f"most {4 << 20} characters, got {len(value) + len('manifest')}",
    )
    assert run.trainer.status().current_version == 0
    limit = (4 << 20) - len("manifest")  # at the bound: accepted
    assert run.trainer.publish_version(1, {"manifest": "x" * limit}) == []


def test_versions_above_the_maximum_are_refused_and_versions_still_increase(run):
    assert MAX_VERSION == 2**31 - 1
    code, message = _refusal(lambda: run.trainer.publish_version(2**63 - 1))
    assert (code, message) == (
        "INVALID_ARGUMENT",
        f"version: expected at most {MAX_VERSION} (the gateway's MAX_VERSION: versions only "
        f"increase, so a larger one would leave no room), got {2**63 - 1}",
    )
    assert _refusal(lambda: run.trainer.publish_version(MAX_VERSION + 1))[1].endswith(
        f"got {MAX_VERSION + 1}"
    )
    run.trainer.publish_version(1)
    run.trainer.publish_version(MAX_VERSION)  # the maximum itself is a version
    assert run.trainer.status().current_version == MAX_VERSION


@pytest.mark.parametrize("method", ["PublishVersion", "RegisterEngine", "Shutdown"])
def test_request_bytes_that_do_not_parse_are_invalid_argument(run, method):
    with grpc.insecure_channel(run.server.address) as channel:
        call = channel.unary_unary(f"/jaxrl.gateway.v1.Gateway/{method}")
        token = TOKENS["engine" if method == "RegisterEngine" else "trainer"]
        with pytest.raises(grpc.RpcError) as err:
            call(b"\xff\xff\xff", metadata=((METADATA_KEY, f"Bearer {token}"),), timeout=10)
        request = {"PublishVersion": "PublishRequest", "RegisterEngine": "RegisterRequest",
                   "Shutdown": "ShutdownRequest"}[method]  # fmt: skip
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (
            f"{request}: expected a serialized {request}, got 3 bytes that do not parse"
        )
        # the token is checked first: garbage without one is UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            call(b"\xff\xff\xff", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    status = run.trainer.status()
    assert not status.shutting_down and status.counters.requests_rejected == 2


def test_the_trainer_drops_an_engine_without_its_key_and_the_event_names_its_role(run):
    a = run.engine.register_engine(SPEC).engine_id
    b = run.engine.register_engine(SPEC).engine_id
    assert run.trainer.drop_engine(a) == 0  # the trainer's token, no key of engine a
    assert run.engine.deregister(b) == 0  # the engine itself, with its key
    events = [(e["engine"], e["by"]) for e in run.state.events.events("deregistered")]
    assert events == [(a, "trainer"), (b, "engine")]
    assert [e.engine_id for e in run.trainer.status().engines] == []
