"""The serving side of a job on the local machine: the gateway process and N engine processes.

`start_gateway` writes fresh tokens to ``RUN_DIR/tokens.txt``, starts ``python -m gateway
serve`` and returns its address once the port file appears and the gateway answers.
`start_engines` starts the engines (each with its own devices, see `trainer.launch.commands`);
`wait_for_engines` returns once `count` of them registered, failing early when a child exits.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from gateway.auth import write_tokens
from gateway.client import GatewayClient
from trainer.launch.commands import engine_argv, engine_env, gateway_argv
from trainer.launch.job_config import JobConfig
from trainer.launch.processes import ProcessSet


def start_gateway(job: JobConfig, procs: ProcessSet, run_dir: Path, family: str) -> str:
    """Start the gateway; returns its HOST:PORT.

    Raises:
      RuntimeError: it exited; TimeoutError: no port file within 60 s.
    """
    write_tokens(run_dir / "tokens.txt")
    port_file = run_dir / "gateway.port"
    port_file.unlink(missing_ok=True)
    procs.start("gateway", gateway_argv(job, run_dir, family), os.environ)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        procs.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway wrote no {port_file} within 60 s")
        time.sleep(0.05)
    host = "127.0.0.1" if job.launch.host in ("0.0.0.0", "::") else job.launch.host
    return f"{host}:{int(port_file.read_text())}"


def start_engines(
    job: JobConfig, procs: ProcessSet, address: str, token_file: Path, model: Path, max_len: int
) -> None:
    """Start launch.num_engines engine processes against the gateway at `address`."""
    for i in range(job.launch.num_engines):
        argv = engine_argv(job, i, address, token_file, model, max_len)
        procs.start(f"engine{i}", argv, engine_env(job, i, os.environ))


def wait_for_engines(
    client: GatewayClient, count: int, timeout_s: float, procs: ProcessSet | None = None
) -> list[str]:
    """Wait until `count` engines are registered; returns their ids.

    Raises:
      RuntimeError: a child process exited (its log's tail inside); TimeoutError: fewer than
        `count` registered within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        engines = list(client.status().engines)
        if len(engines) >= count:
            return [e.engine_id for e in engines]
        if procs is not None:
            procs.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(engines)}/{count} engines registered within {timeout_s} s")
        time.sleep(0.5)
