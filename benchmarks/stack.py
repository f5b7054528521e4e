"""The gateway and one vLLM engine as separate processes, the way the main job starts them:
the stack the weight-push and rollout benchmarks measure through.

Imported by the scripts beside it (`python benchmarks/<name>.py` puts this folder first on
`sys.path`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
from common import CPU_ENV

from gateway.auth import write_tokens
from gateway.client import GatewayClient


def _wait_for(what: str, check, timeout_s: float, procs: list[subprocess.Popen], log: Path):
    end = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        dead = [p.args[2] for p in procs if p.poll() is not None]  # type: ignore[index]
        if dead or time.monotonic() > end:
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise RuntimeError(f"{what} did not happen (exited: {dead}):\n{tail}")
        time.sleep(0.2)


@contextlib.contextmanager
def engine_stack(
    workdir: Path,
    model_dir: Path,
    family: str,
    dtype: str,
    max_model_len: int,
    tp: int = 1,
    transport: str = "gloo",
    engine_args: tuple[str, ...] = (),
):
    """A gateway process (the run's data plane `transport`) and one vLLM engine process at TP
    `tp` on `model_dir` (`engine_args`: more `python -m rollout_engine` flags); yields (trainer
    client, engine process). Both processes are shut down (killed if need be) on exit.

    Raises:
        RuntimeError: the gateway or the engine exited, or did not start in time (the log's
            tail inside).
    """
    tokens = workdir / "tokens.txt"
    write_tokens(tokens)
    port_file, gw_log, engine_log = workdir / "port", workdir / "gw.log", workdir / "engine.log"
    procs: list[subprocess.Popen] = []
    children: list[psutil.Process] = []  # the engine's vLLM processes, killed if left behind
    trainer = None
    try:
        gw_args = ["--token-file", str(tokens), "--port-file", str(port_file), "--family", family]
        gw_args += ["--dtype", dtype, "--transport", transport, "--log-level", "WARNING"]
        with open(gw_log, "w") as out:
            procs.append(
                subprocess.Popen([sys.executable, "-m", "gateway", "serve", *gw_args], stderr=out)
            )
        port = _wait_for(
            "gateway start", lambda: port_file.exists() and port_file.read_text(), 30, procs, gw_log
        ).strip()
        address = f"127.0.0.1:{port}"
        args = ["--backend", "vllm", "--gateway", address, "--token-file", str(tokens)]
        args += ["--model", str(model_dir), "--dtype", dtype, "--name", "bench"]
        args += ["--vllm-max-model-len", str(max_model_len), "--log-level", "WARNING"]
        args += ["--vllm-tensor-parallel-size", str(tp), *engine_args]
        env = {**os.environ, **CPU_ENV}
        if tp > 1:  # one core per TP worker
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
        with open(engine_log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "rollout_engine", *args],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
        trainer = GatewayClient.from_token_file(address, tokens, "trainer")
        _wait_for(
            "engine registration",
            lambda: len(trainer.status().engines) == 1,
            600,
            procs,
            engine_log,
        )
        children = psutil.Process(procs[1].pid).children(recursive=True)
        yield trainer, procs[1]
        trainer.shutdown("benchmark over")
        procs[1].wait(60)
    finally:
        if trainer is not None:
            trainer.close()
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(20)
        for c in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                if c.is_running():
                    c.kill()
