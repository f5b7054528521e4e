"""Timeouts that measure silence, clean stops and early refusals, with a real gateway process and
a real `python -m rollout_engine` JAX engine process.

- An evaluation of 32 groups whose engine is slowed (SIGSTOP / SIGCONT: stopped 2.5 s before
  it and after every 6 groups returned, so for longer than the 6 s eval timeout in total but
  never silent for longer than it) completes; an engine
  stopped for longer than the timeout fails the wait with a message naming it.
- An engine with a wrong token, or facing a dead gateway, exits with status 1 before it starts
  its backend; SIGTERM ends an engine whose gateway is gone within its stop bound (its retry
  window is 10 minutes: the old stop retried deregistration for all of it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gateway import messages as m
from gateway.client import GatewayClient
from tests.integration.smoke_job import child_env
from trainer.data.problem import Problem
from trainer.launch.evaluate import evaluate
from trainer.rewards import ScoringPool, TokenFractionVerifier

_spec = importlib.util.spec_from_file_location("waits", Path(__file__).with_name("waits.py"))
waits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(waits)
wait_for, exit_status = waits.wait_for, waits.exit_status

TOKENS = {"trainer": "trainer-token-0123456789", "engine": "engine-token-0123456789"}
SAMPLING = m.SamplingParams(temperature=1.0, max_new_tokens=16)
STOP_S, EVERY, TIMEOUT_S = 2.5, 6, 6.0  # each stop is far shorter than the eval timeout


def _problems(n: int) -> list[Problem]:
    return [Problem(str(i), "", "", "token_fraction", {"token_id": 5}) for i in range(n)]


def _encode(p: Problem) -> list[int]:
    return [1, 2, 10 + int(p.problem_id)]


def _gateway(tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    tokens, port_file = tmp_path / "tokens.txt", tmp_path / "gateway.port"
    tokens.write_text("".join(f"{k}={v}\n" for k, v in TOKENS.items()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--token-file", str(tokens),
         "--port-file", str(port_file), "--family", "llama", "--dtype", "float32",
         "--transport", "gloo", "--heartbeat-timeout", "120", "--log-level", "WARNING"],
        start_new_session=True,
    )  # fmt: skip
    wait_for(lambda: port_file.exists() and port_file.read_text().strip(), [proc], "the port file")
    return proc, f"127.0.0.1:{port_file.read_text().strip()}", tokens


def _engine(address: str, tokens: Path, model: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = child_env()
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rollout_engine", "--backend", "jax", "--gateway", address,
             "--token-file", str(tokens), "--model", str(model), "--dtype", "float32",
             "--transports", "gloo", "--name", "slowed", "--log-level", "INFO",
             "--jax-num-slots", "8", "--jax-max-model-len", "32", "--jax-prefill-batch", "1",
             "--jax-steps-per-call", "4", *extra],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):  # the group: a child of it may be left
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    proc.wait()


@pytest.mark.slow
def test_slowed_engine_finishes_the_eval_stopped_engine_fails_it_sigterm_ends_it(
    tmp_path, tiny_checkpoint
):
    gateway, address, tokens = _gateway(tmp_path)
    log = tmp_path / "engine.log"
    engine = _engine(
        address, tokens, tiny_checkpoint("llama"), log,
        "--max-concurrent-prompts", "1", "--lease-batch", "1",
        "--gateway-retry-s", "600", "--drain-s", "600", "--stop-s", "2",
    )  # fmt: skip
    client = GatewayClient(address, TOKENS["trainer"], margin_s=5.0)
    try:
        wait_for(lambda: client.status().engines, [engine, gateway], "the engine's registration")
        (engine_id,) = [e.engine_id for e in client.status().engines]
        verifiers = {"token_fraction": TokenFractionVerifier()}
        with ScoringPool(verifiers=verifiers) as scoring:

            def run_eval(tag: str, n: int, timeout_s: float):
                return evaluate(
                    client, _problems(n), _encode, scoring, SAMPLING, samples=8, version=0,
                    tag=tag, timeout_s=timeout_s,
                )  # fmt: skip

            run_eval("warm", 2, 3600.0)  # the engine compiles its prefill and decode here

            # slowed: stopped STOP_S at a time, before the eval and again after every EVERY
            # groups it returned (so however fast it runs, it is stopped 32 / EVERY times)
            done, stops, out = threading.Event(), [0], {}

            def returned() -> int:
                return int(client.status().counters.groups_returned)

            def pause() -> None:
                os.killpg(engine.pid, signal.SIGSTOP)
                stops[0] += 1
                done.wait(STOP_S)
                os.killpg(engine.pid, signal.SIGCONT)

            def slow_down() -> None:
                mark = returned()
                pause()
                while not done.is_set():
                    if returned() >= mark + EVERY:
                        mark = returned()
                        pause()
                    done.wait(0.02)

            driver = threading.Thread(target=slow_down, daemon=True)
            driver.start()
            try:
                out["result"] = run_eval("slowed", 32, TIMEOUT_S)
            finally:
                done.set()
                driver.join()
            result = out["result"]
            print(f"slowed eval: {stops[0]} stops, {result.seconds:.1f} s")
            assert (result.problems, result.samples) == (32, 8)
            assert stops[0] * STOP_S > TIMEOUT_S  # stopped for longer than the timeout in all

            # stopped for longer than the timeout: the wait fails naming the engine
            os.killpg(engine.pid, signal.SIGSTOP)
            try:
                with pytest.raises(TimeoutError) as err:
                    run_eval("stopped", 4, 3.0)
            finally:
                os.killpg(engine.pid, signal.SIGCONT)
        text = str(err.value)
        assert "eval 'stopped' at version 0: 0/4 eval groups" in text
        assert "eval.timeout_s=3" in text and "came from nobody" in text
        assert f"{engine_id} (slowed) last seen" in text

        # the gateway vanishes; SIGTERM still ends the engine at once with status 0
        gateway.kill()
        gateway.wait()
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(120) == 0  # retry window and drain are 600 s each
        assert "stopping: stopped" in log.read_text()
    finally:
        client.close()
        _stop(engine)
        _stop(gateway)


def test_wrong_token_and_dead_gateway_are_refused_before_the_backend_starts(
    tmp_path, tiny_checkpoint
):
    gateway, address, tokens = _gateway(tmp_path)
    model = tiny_checkpoint("llama")
    bad = tmp_path / "bad_tokens.txt"
    bad.write_text("trainer=not-the-trainer-token-0123\nengine=not-the-engine-token-0123\n")
    try:
        log = tmp_path / "wrong_token.log"
        proc = _engine(address, bad, model, log)
        assert exit_status(proc, "the engine's exit") == 1
        text = log.read_text()
        assert f"refused the engine token from {bad}" in text
        assert "starting the jax backend" not in text
    finally:
        _stop(gateway)
    log = tmp_path / "dead_gateway.log"
    proc = _engine(address, tokens, model, log, "--gateway-retry-s", "2")
    assert exit_status(proc, "the engine's exit") == 1
    text = log.read_text()
    assert f"no gateway answered at {address} within 2.0 s" in text
    assert "the backend was not started" in text and "starting the jax backend" not in text
