"""`python -m gateway serve|status|make-tokens` as real processes: fast start, status, stop."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from gateway import messages as m
from gateway.client import GatewayClient

_spec = importlib.util.spec_from_file_location("waits", Path(__file__).with_name("waits.py"))
waits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(waits)

# CPU seconds the gateway process may spend until it listens: CPU time, not wall time, so a
# machine loaded by other work slows the start without failing it
START_LIMIT_S = 1.0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (its threads included), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gateway(tmp_path, *extra):
    tokens, port_file = tmp_path / "tokens", tmp_path / "port"
    if not tokens.exists():
        subprocess.run([sys.executable, "-m", "gateway", "make-tokens", str(tokens)], check=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", "0", "--port-file", str(port_file),
         "--token-file", str(tokens), "--log-level", "WARNING", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    waits.wait_for(lambda: port_file.exists(), [proc], "the gateway's port file", poll_s=0.005)
    return proc, _cpu_s(proc.pid), f"127.0.0.1:{port_file.read_text()}", tokens


def test_gateway_imports_no_ml_library():
    code = (
        "import sys, gateway.cli, gateway.server, gateway.client, gateway.heartbeat; "
        "print(sorted(m for m in ('jax', 'torch', 'vllm', 'flax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_serve_starts_fast_reports_status_and_stops(tmp_path):
    proc, started_s, address, tokens = _gateway(tmp_path, "--family", "llama")
    try:
        assert started_s < START_LIMIT_S, f"the gateway took {started_s:.2f} CPU s to listen"
        with GatewayClient.from_token_file(address, tokens, "engine") as engine:
            spec = m.EngineSpec("vllm", "llama", "bfloat16", ("gloo",), tp_size=2, device_count=2)
            reg = engine.register_engine(spec)
            engine.report_metrics(reg.engine_id, 1, {"tokens_per_s": 99.0})
        base = [sys.executable, "-m", "gateway", "status", "--address", address]
        text = subprocess.run(
            [*base, "--token-file", str(tokens)], capture_output=True, text=True, check=True
        ).stdout
        assert "version 0  family llama" in text
        assert "queues: eval 0  train 0  leased 0  ready 0/4096" in text
        assert f"  {reg.engine_id}  vllm tp2/2  v0 (loaded)" in text
        assert "tokens_per_s=99" in text
        raw = subprocess.run(
            [*base, "--token-file", str(tokens), "--role", "engine", "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        status = json.loads(raw)
        assert [e["engine_id"] for e in status["engines"]] == [reg.engine_id]
        assert status["settings"]["model_family"] == "llama"
        proc.send_signal(signal.SIGTERM)
        assert waits.exit_status(proc, "the gateway's exit after SIGTERM") == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_status_with_a_wrong_token_fails_cleanly(tmp_path):
    proc, _, address, _ = _gateway(tmp_path)
    try:
        bad = tmp_path / "bad"
        bad.write_text("trainer=" + "x" * 20 + "\nengine=" + "y" * 20 + "\n")
        out = subprocess.run(
            [sys.executable, "-m", "gateway", "status", "--address", address,
             "--token-file", str(bad)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert out.returncode == 1
        assert "UNAUTHENTICATED" in out.stderr
    finally:
        proc.kill()
        proc.wait()


def test_trainer_shutdown_stops_the_process(tmp_path):
    proc, _, address, tokens = _gateway(tmp_path)
    with GatewayClient.from_token_file(address, tokens, "trainer") as trainer:
        trainer.shutdown("test")
    assert waits.exit_status(proc, "the gateway's exit after a shutdown") == 0
