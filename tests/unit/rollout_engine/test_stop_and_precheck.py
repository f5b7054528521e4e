"""An engine's stop is bounded whatever the gateway's state, and what can be checked before the
backend starts is: the gateway answers, takes the token, and runs a model the engine serves."""

import importlib.util
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gateway import messages as m
from gateway.client import GatewayClient, RegistrationRefused
from gateway.errors import UNAVAILABLE, GatewayError
from rollout_engine.precheck import TokenRefused, precheck

_spec = importlib.util.spec_from_file_location(
    "worker_harness", Path(__file__).with_name("worker_harness.py")
)
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)

SPEC = m.EngineSpec(backend="jax", model_family="llama", dtype="float32", transports=("gloo",))


def _gateway_process(tmp_path) -> tuple[subprocess.Popen, str]:
    """`python -m gateway serve` on a free port (family llama); returns it and its address."""
    tokens, port_file = tmp_path / "tokens.txt", tmp_path / "port"
    tokens.write_text("".join(f"{role}={tok}\n" for role, tok in h.TOKENS.items()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--token-file", str(tokens), "--port-file",
         str(port_file), "--family", "llama", "--log-level", "WARNING"],
    )  # fmt: skip
    while not (port_file.exists() and port_file.read_text().strip()):
        assert proc.poll() is None, "the gateway exited"
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


@pytest.mark.parametrize("in_flight", [0, 1])
def test_stop_with_the_gateway_gone_ends_within_stop_s(tmp_path, in_flight):
    proc, address = _gateway_process(tmp_path)
    engine = GatewayClient(address, h.TOKENS["engine"], margin_s=5.0)
    trainer = GatewayClient(address, h.TOKENS["trainer"], margin_s=5.0)
    backend = h.FakeBackend()
    backend.holds["stuck"] = threading.Event()
    # a retry window and drain of 10 minutes: the old stop retried deregistration for all of it
    run = h.WorkerThread(engine, backend, gateway_retry_s=600.0, drain_s=600.0, stop_s=1.0)
    try:
        run.wait_registered()
        if in_flight:
            trainer.submit_prompts([h.prompt("stuck", [1])])
            while not backend.calls:
                time.sleep(0.01)
        proc.kill()  # the gateway vanishes: no shutdown message reaches the engine
        proc.wait(30)
        run.worker.request_stop()
        # the ceiling is far below the 600 s retry window and drain, far above stop_s
        assert run.join(timeout_s=120.0) == "stopped"
        assert [c[0] for c in backend.calls] == (["stuck"] if in_flight else [])
    finally:
        trainer.close()
        engine.close()
        proc.kill()
        proc.wait(30)


def test_precheck_accepts_a_configured_run_and_an_unconfigured_one():
    server, trainer, engine = h.start_gateway(model_family="")
    try:
        assert precheck(engine, SPEC, 5.0) == "unconfigured"
        trainer.configure(m.RunSettings(model_family="llama", dtype="float32", transport="gloo"))
        assert precheck(engine, SPEC, 5.0) == "configured"
    finally:
        trainer.close()
        engine.close()
        server.stop(0)


def test_precheck_refuses_a_wrong_token_a_dead_gateway_and_a_wrong_family():
    server, trainer, engine = h.start_gateway()
    try:
        with GatewayClient(server.address, "not-a-token-0123456789", margin_s=5.0) as bad:
            with pytest.raises(TokenRefused, match=r"refused the engine token from t\.txt"):
                precheck(bad, SPEC, 5.0, "t.txt")
        trainer.configure(m.RunSettings(model_family="qwen2", dtype="float32"))
        with pytest.raises(RegistrationRefused, match="model family differs"):
            precheck(engine, SPEC, 5.0)
        address = server.address
    finally:
        trainer.close()
        engine.close()
        server.stop(0)
    with GatewayClient(address, h.TOKENS["engine"], margin_s=1.0) as gone:
        with pytest.raises(GatewayError, match="within 0.5 s .*backend was not started") as e:
            precheck(gone, SPEC, 0.5)
    assert e.value.code == UNAVAILABLE
