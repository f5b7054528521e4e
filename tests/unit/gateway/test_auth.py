"""Tokens and roles over a real loopback server: no or wrong token, wrong role, token files."""

import os

import grpc
import pytest

from gateway import messages as m
from gateway.auth import load_tokens, write_tokens
from gateway.client import GatewayClient
from gateway.errors import GatewayError
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc


def _code(fn):
    with pytest.raises(GatewayError) as err:
        fn()
    return err.value.code, err.value.message


def test_missing_or_wrong_token_is_unauthenticated(server):
    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(server.server.address))
    with pytest.raises(grpc.RpcError) as err:
        stub.GetStatus(gpb.StatusRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "expected 'authorization: Bearer <token>' metadata, got none" in err.value.details()
    for token in ("", "x" * 24, server.trainer._metadata[0][1][7:] + "x"):
        with GatewayClient(server.server.address, token) as bad:
            code, msg = _code(bad.status)
            assert code == "UNAUTHENTICATED" and "matching no role" in msg
            assert _code(lambda b=bad: b.publish_version(1))[0] == "UNAUTHENTICATED"


def test_engine_token_cannot_act_as_trainer(server):
    e = server.engine
    trainer_only = {
        "PublishVersion": lambda: e.publish_version(1),
        "Shutdown": lambda: e.shutdown("nope"),
        "SubmitPrompts": lambda: e.submit_prompts([]),
        "FetchRollouts": lambda: e.fetch_rollouts(1, 0.0),
        "Configure": lambda: e.configure(m.RunSettings(model_family="x")),
        "WaitSync": lambda: e.wait_sync(0, 0.0),
    }
    for name, call in trainer_only.items():
        code, msg = _code(call)
        assert code == "PERMISSION_DENIED"
        assert msg == f"{name}: expected a token of role trainer, got role engine"
    status = server.trainer.status()
    assert status.current_version == 0 and not status.shutting_down
    assert status.settings.model_family == "llama"


def test_trainer_token_cannot_act_as_engine(server):
    t = server.trainer
    spec = m.EngineSpec(backend="jax", model_family="llama", dtype="bf16", transports=("gloo",))
    for call in (
        lambda: t.register_engine(spec),
        lambda: t.lease_prompts("e-1", 1, 0.0),
        lambda: t.ack_version("e-1", 0),
        lambda: t.heartbeat("e-1"),
    ):
        code, msg = _code(call)
        assert code == "PERMISSION_DENIED" and msg.endswith("got role trainer")
    assert len(server.engine.status().engines) == 0


def test_both_roles_may_read_status_and_report_metrics(server):
    server.engine.report_metrics("engine-x", 3, {"tokens_per_s": 12.5})
    server.trainer.report_metrics("trainer", 7, {"reward": 0.25})
    reports = {r.source: (r.step, dict(r.values)) for r in server.engine.status().metrics}
    assert reports == {"engine-x": (3, {"tokens_per_s": 12.5}), "trainer": (7, {"reward": 0.25})}


def test_token_file_round_trip_and_mode(tmp_path):
    path = tmp_path / "tokens"
    tokens = write_tokens(path)
    assert load_tokens(path) == tokens
    assert set(tokens) == {"trainer", "engine"} and tokens["trainer"] != tokens["engine"]
    assert os.stat(path).st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("trainer=" + "a" * 20 + "\n", "missing ['engine']"),
        ("trainer=" + "a" * 20 + "\nengine=" + "a" * 20, "different trainer and engine tokens"),
        ("trainer=short\nengine=" + "b" * 20, "expected a token of >= 16 characters, got 5"),
        ("admin=" + "a" * 20, "expected 'trainer=TOKEN' or 'engine=TOKEN'"),
        ("trainer=" + "a" * 20 + "\ntrainer=" + "c" * 20, "expected each role once"),
    ],
)
def test_bad_token_files_are_refused(tmp_path, text, expected):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ValueError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        load_tokens(path)
