"""Shared by the vLLM integration tests (loaded by path): transformers references, the sender
process handle, the engine fixture's body, and `stack` (a gateway and one engine process)."""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from gateway.auth import write_tokens
from gateway.client import GatewayClient
from transport.manifest import Manifest

SENDER = Path(__file__).with_name("vllm_weight_sender.py")
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        nxt = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


class Sender:
    """The sender process: commands on stdin, replies on stdout."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SENDER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        kind, port = self._line()
        assert kind == "port"
        self.port = int(port)

    def _line(self) -> tuple[str, str]:
        line = self.proc.stdout.readline()
        assert line, f"sender exited with {self.proc.poll()}"
        kind, _, rest = line.strip().partition(" ")
        return kind, rest

    def offer(self, cmd: str, model_dir: Path, version: int, bucket_bytes: int) -> Manifest:
        self.proc.stdin.write(f"{cmd} {model_dir} {version} {bucket_bytes}\n")
        self.proc.stdin.flush()
        kind, rest = self._line()
        assert kind == "manifest", rest
        return Manifest.from_dict(json.loads(rest))

    def result(self) -> tuple[str, str]:
        return self._line()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def engine_world(model_a: Path, max_model_len: int = 512):
    """Generator for a module fixture: a vLLM engine on `model_a` (fp32) joined over gloo to a
    sender process. Yields (loop, backend, sender)."""
    from rollout_engine.vllm.backend import VllmBackend, VllmBackendConfig

    saved = {k: os.environ.get(k) for k in CPU_ENV}
    os.environ.update(CPU_ENV)
    loop = asyncio.new_event_loop()
    cfg = VllmBackendConfig(model=str(model_a), dtype="float32", max_model_len=max_model_len)
    backend = VllmBackend(cfg)
    sender = None
    try:
        loop.run_until_complete(backend.start())
        sender = Sender()  # after the engine is up: its rendezvous waits at most 120 s
        transport = {"kind": "gloo", "host": "127.0.0.1", "port": sender.port, "timeout_s": 120}
        loop.run_until_complete(backend.connect_transport(transport))
        yield loop, backend, sender
    finally:
        loop.run_until_complete(backend.shutdown())
        if sender is not None:
            sender.close()
        loop.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_for(what: str, check, timeout_s: float, proc: subprocess.Popen, log: Path):
    end = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if proc.poll() is not None or time.monotonic() > end:
            tail = log.read_text()[-4000:] if log.exists() else ""
            raise AssertionError(f"{what} did not happen (exit {proc.poll()}):\n{tail}")
        time.sleep(0.2)


@contextlib.contextmanager
def stack(
    tmp_path: Path,
    model_a: Path,
    backend_args: list[str],
    sigterm: bool = False,
    family: str = "llama",
    env: dict[str, str] | None = None,
):
    """A gateway process and one engine process on model A; yields (trainer client, engine
    process, engine log). At exit the trainer shuts the gateway down (or, with `sigterm`, the
    engine gets SIGTERM and must deregister) and the engine must exit with status 0."""
    tokens = tmp_path / "tokens.txt"
    write_tokens(tokens)
    port_file, gw_log, engine_log = tmp_path / "port", tmp_path / "gw.log", tmp_path / "engine.log"
    procs: list[subprocess.Popen] = []
    gw_args = ["--token-file", str(tokens), "--port-file", str(port_file), "--family", family]
    gw_args += ["--dtype", "float32", "--transport", "gloo", "--log-level", "WARNING"]
    with open(gw_log, "w") as out:
        gw = subprocess.Popen([sys.executable, "-m", "gateway", "serve", *gw_args], stderr=out)
    procs.append(gw)
    trainer = None
    try:
        port = _wait_for("gateway start", lambda: port_file.exists() and port_file.read_text(),
                         1800, gw, gw_log).strip()  # fmt: skip
        address = f"127.0.0.1:{port}"
        args = ["--gateway", address, "--token-file", str(tokens), "--model", str(model_a)]
        args += ["--dtype", "float32", "--name", "e2e", "--max-concurrent-prompts", "8"]
        with open(engine_log, "w") as out:
            engine = subprocess.Popen(
                [sys.executable, "-m", "rollout_engine", *args, *backend_args],
                env={**os.environ, **CPU_ENV, **(env or {})}, stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        procs.append(engine)
        trainer = GatewayClient.from_token_file(address, tokens, "trainer")
        _wait_for("engine registration", lambda: len(trainer.status().engines) == 1,
                  1800, engine, engine_log)  # fmt: skip
        yield trainer, engine, engine_log
        if sigterm:
            engine.send_signal(signal.SIGTERM)
            assert engine.wait(1800) == 0, engine_log.read_text()[-4000:]
            assert len(trainer.status().engines) == 0  # it deregistered on its way out
        trainer.shutdown("test over")
        assert engine.wait(1800) == 0, engine_log.read_text()[-4000:]
    finally:
        if trainer is not None:
            trainer.close()
        for p in reversed(procs):
            if p.poll() is None:
                p.kill()
                p.wait(30)
