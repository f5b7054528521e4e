"""The main job laid out on the hosts of a cluster in a box: the gateway (TLS with the project's
own certificate, a pinned port) and trainer process 0 on one host, the other trainer
processes and each engine on hosts of their own, every process started with the launcher's
own command lines (`trainer.launch.commands`) through `ClusterBox.popen`; and the port table
each role's host admits (docs/clusters.md, "Ports").

Used by the tests (tests/integration/cluster_harness.py) and by benchmarks/cross_host.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deploy.local.cluster_box import EPHEMERAL, ClusterBox
from gateway.auth import write_tokens
from gateway.certs import make_cert
from models.checkpoints.hf_io import read_hf_config
from models.config import ModelConfig
from trainer.launch.commands import engine_argv, engine_env, gateway_argv, trainer_env
from trainer.launch.job_config import JobConfig, load_job_config
from trainer.launch.model_source import resolve_model

REPO = Path(__file__).resolve().parents[2]
GATEWAY_PORT = 50051
"""The gateway's pinned gRPC port (launch.port)."""
COORDINATOR_PORT = 50052
"""jax.distributed's coordinator on trainer process 0's host (--coordinator HOST:PORT)."""
STORE_PORTS = (50060, 50063)
"""The data plane's rendezvous store: launch.data_plane_port=50060, data_plane_port_count=4."""

ROLE_PORTS: dict[str, list[int | tuple[int, int]]] = {
    "gateway": [GATEWAY_PORT],
    "trainer0": [COORDINATOR_PORT, STORE_PORTS, EPHEMERAL],
    "trainer": [EPHEMERAL],
    "engine": [EPHEMERAL],
}
"""What each role's host admits (docs/clusters.md, ports): the gateway its gRPC port; trainer
process 0 the coordinator, the store's range and the ephemeral range (gloo listeners of the
data plane and of JAX's CPU collectives); other trainer processes and engines the ephemeral
range (their gloo listeners)."""


def child_env(cache: Path | None, drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a process of the job: without XLA_FLAGS (each process
    gets its own device count) and without the `drop` names, on CPU, unbuffered, with the model
    cache (`JAXRL_CACHE_DIR`) at `cache` when given, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and k not in drop}
    env |= {"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    if cache is not None:
        env["JAXRL_CACHE_DIR"] = str(cache)
    return env | extra


@dataclass
class MainJobOnHosts:
    """The smoke main job laid out on the hosts of `box`: `gateway_host` runs the gateway and
    trainer process 0, `trainer_hosts[1:]` the other trainer processes, `engine_hosts[i]`
    engine i (backend ``launch.engine_backends[i]``). Logs go to ``run_dir/logs``.

    `overrides` are config overrides (``key=value``) on `config` (default configs/smoke.yaml);
    the host-specific ones (gateway, token file, CA, data-plane host and ports) are added
    here; `cache` is the model cache (``JAXRL_CACHE_DIR``) of every process. `gateway_on`
    puts the gateway on a host of its own; `gateway_args` go on its command line (e.g.
    ``--heartbeat-timeout 8``).
    """

    box: ClusterBox
    run_dir: Path
    cache: Path
    trainer_hosts: list[str]
    engine_hosts: list[str]
    overrides: list[str] = field(default_factory=list)
    firewall: bool = True
    gateway_on: str = ""
    gateway_args: list[str] = field(default_factory=list)
    config: Path = REPO / "configs" / "smoke.yaml"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    model: Path | None = field(default=None, init=False)  # the model folder `start` resolved

    @property
    def gateway_host(self) -> str:
        """The gateway's host: `gateway_on`, else trainer process 0's."""
        return self.gateway_on or self.trainer_hosts[0]

    @property
    def gateway(self) -> str:
        return f"{self.box.address(self.gateway_host)}:{GATEWAY_PORT}"

    def job(self, host: str) -> JobConfig:
        """The job config as the process on `host` loads it."""
        return load_job_config(str(self.config), self._overrides(host))

    def _overrides(self, host: str) -> list[str]:
        certs = self.run_dir / "certs"
        return [
            f"run_dir={self.run_dir}", *self.overrides,
            f"launch.gateway={self.gateway}", f"launch.token_file={self.run_dir / 'tokens.txt'}",
            f"launch.gateway_ca_file={certs / 'gateway.pem'}",
            f"launch.host={self.box.address(self.gateway_host)}", f"launch.port={GATEWAY_PORT}",
            f"launch.data_plane_host={self.box.address(host)}",
            f"launch.data_plane_port={STORE_PORTS[0]}",
            f"launch.data_plane_port_count={STORE_PORTS[1] - STORE_PORTS[0] + 1}",
            f"launch.num_engines={len(self.engine_hosts)}",
        ]  # fmt: skip

    def _start(self, name: str, host: str, argv: list[str], env: dict[str, str]) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"{name}.log").open("ab") as out:
            self.procs[name] = self.box.popen(
                host, argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT
            )

    def log(self, name: str) -> str:
        """The log of process `name` (gateway, engine0.., trainer0..)."""
        return (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace")

    def apply_firewalls(self) -> None:
        """Each host admits only its roles' ports (`ROLE_PORTS`)."""
        for host in {self.gateway_host, *self.trainer_hosts, *self.engine_hosts}:
            roles = ["gateway"] if host == self.gateway_host else []
            roles += ["trainer0"] if host == self.trainer_hosts[0] else []
            roles += ["trainer"] if host in self.trainer_hosts[1:] else []
            roles += ["engine"] if host in self.engine_hosts else []
            self.box.firewall(host, sorted({p for r in roles for p in ROLE_PORTS[r]}, key=str))

    def start(self, model: Path | None = None, max_len: int = 256) -> None:
        """Make the tokens and the gateway's certificate, then start the gateway, the engines
        and the trainer processes, each on its host."""
        if self.firewall:
            self.apply_firewalls()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_tokens(self.run_dir / "tokens.txt")
        gw_host = self.gateway_host
        make_cert(self.run_dir / "certs", [gw_host, self.box.address(gw_host)])
        job = self.job(gw_host)
        env = child_env(self.cache)
        model = model or resolve_model(job.run.model.path)
        self.model = model
        family = ModelConfig.from_hf(read_hf_config(model)).family
        certs = self.run_dir / "certs"
        argv = gateway_argv(job, self.run_dir, family)
        argv += ["--cert", str(certs / "gateway.pem"), "--key", str(certs / "gateway.key")]
        argv += self.gateway_args
        self._start("gateway", gw_host, argv, env)
        self.wait_for_file(self.run_dir / "gateway.port", 60)
        for i, host in enumerate(self.engine_hosts):
            ej = self.job(host)
            argv = engine_argv(ej, i, self.gateway, self.run_dir / "tokens.txt", model, max_len)
            argv += ["--ca-file", str(certs / "gateway.pem"), "--name", f"engine{i}-{host}"]
            self._start(f"engine{i}", host, argv, engine_env(ej, i, env))
        self.start_trainers()

    def start_trainers(self, extra: Sequence[str] = ()) -> None:
        """Start trainer process i on `trainer_hosts[i]` (one jax.distributed job whose
        coordinator is on the first; a single trainer host runs ``python -m trainer train``
        joined to the gateway), with config overrides `extra` after the others."""
        coordinator = f"{self.box.address(self.trainer_hosts[0])}:{COORDINATOR_PORT}"
        n = len(self.trainer_hosts)
        for i, host in enumerate(self.trainer_hosts):
            job = self.job(host)
            env = child_env(self.cache) | trainer_env(job, {})
            config = ["--config", str(self.config)]
            if n == 1:
                argv = [sys.executable, "-m", "trainer", "train", *config,
                        "launch.progress=false"]  # fmt: skip
            else:
                argv = [
                    sys.executable, "-m", "trainer.launch.trainer_worker", *config,
                    "--run-dir", str(self.run_dir), "--process-id", str(i),
                    "--num-processes", str(n), "--coordinator", coordinator,
                    "--gateway", self.gateway, "--token-file", str(self.run_dir / "tokens.txt"),
                    "--model", str(self.model),
                ]  # fmt: skip
            self._start(f"trainer{i}", host, [*argv, *self._overrides(host), *extra], env)

    def result(self) -> dict:
        """The trainer's result: trainer_result.json (several processes) or job_summary.json
        (one), as written by trainer process 0."""
        for name in ("trainer_result.json", "job_summary.json"):
            if (self.run_dir / name).exists():
                return json.loads((self.run_dir / name).read_text())
        raise FileNotFoundError(f"no trainer result in {self.run_dir}")

    def events(self) -> list[dict]:
        """The gateway's events so far (logs/gateway_events.jsonl), oldest first."""
        path = self.run_dir / "logs" / "gateway_events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def wait_for_file(self, path: Path, timeout_s: float) -> None:
        """Until `path` exists; fails naming the process that exited first, with its log."""
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {path} within {timeout_s} s")
            time.sleep(0.1)

    def check_alive(self, names: Sequence[str] | None = None) -> None:
        """Raise RuntimeError (with the log's tail) if a process of `names` (default all but
        the trainers, which end on their own) has exited."""
        for name, proc in self.procs.items():
            if names is None and name.startswith("trainer"):
                continue
            if (names is None or name in names) and proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}"
                )

    def wait_trainers(self, timeout_s: float) -> list[int | None]:
        """Wait until every trainer process ended (others must stay up meanwhile); returns
        their exit codes in order (None: still running at the deadline)."""
        deadline = time.monotonic() + timeout_s
        trainers = [n for n in self.procs if n.startswith("trainer")]
        while time.monotonic() < deadline:
            if all(self.procs[n].poll() is not None for n in trainers):
                break
            self.check_alive()
            time.sleep(0.5)
        return [self.procs[n].poll() for n in trainers]

    def stop(self) -> None:
        """SIGTERM every process, SIGKILL what is left after 10 s (the box's `down` kills what
        escaped)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
