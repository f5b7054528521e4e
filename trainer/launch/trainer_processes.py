"""``launch.trainer_processes=P``: the launcher starts P trainer processes on the local machine.

Design. The launcher (the ``python -m trainer train`` process the user started) stays out of
the `jax.distributed` group: it starts the gateway and the engines as with one trainer, then P
trainer processes (``python -m trainer.launch.trainer_worker``, process ids 0..P-1, one
coordinator port on 127.0.0.1 picked free, `launch.trainer_devices` local devices each), and
watches them. Process 0 runs the single-process training path (`trainer.launch.training`:
gateway client, scoring, filters, publisher, metrics.jsonl, summary.json, progress bar and
TensorBoard; its output is the launcher's own stdout/stderr), and leads the others
(`trainer.leader`). The other choice, the launcher itself as process 0 starting P-1
followers, was rejected: when a peer dies, JAX's coordination service ends every survivor
(an abort, no Python code runs: `trainer.distributed`), and a launcher ended that way could
not stop the gateway and engines it started, each in its own session, nor say what happened.
Out of the group, the launcher survives any trainer process and always cleans up.

What the launcher does while they run (`run_trainer_processes`):
- it supervises the engines (`EngineSupervisor`: restarts; fewer than launch.min_engines
  alive stops the run), which trainer process 0 cannot do since they are not its children;
- a SIGINT/SIGTERM (a graceful stop, `trainer.launch.interrupt`) is passed to process 0 as
  SIGINT, which finishes the update under way, checkpoints on every process and tells the
  followers to stop (the job's stop reason and exit status name the signal the launcher got);
  a second signal stops everything at once. SIGTERM is what `ProcessSet.stop_all` sends when
  the job ends: process 0 then exits at once (status 143), even while it waits on the gateway
  or on a lost peer;
- the first trainer process to exit with a non-zero status is the lost one: JAX ends the
  others promptly (observed), and the launcher raises `TrainerProcessLost`
  naming it (its id, pid, exit status, log), after which `ProcessSet` stops every child.
Process 0 writes its result (the job summary's fields) to ``RUN_DIR/trainer_result.json``.

Pushes: over gloo or NCCL every trainer process sends its own blocks of each version
(`transport.fan_in`, `trainer.publish.local_shards`, `trainer.publish.co_sender`); over the
file or shm data plane the params are gathered onto every process and process 0 writes them
(`trainer.leader.gather_params`). Loading: every process memory-maps the safetensors and
copies out only the slices its devices hold (`models.checkpoints.hf_io.load_hf_checkpoint`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.launch import interrupt
from trainer.launch.commands import resolve_accelerator
from trainer.launch.job_config import JobConfig
from trainer.launch.processes import ProcessSet

#: Seconds between two looks at the trainer processes.
POLL_S = 0.1
#: Name of trainer process i among the launcher's children.
NAME = "trainer{}"


class TrainerProcessLost(RuntimeError):
    """A trainer process exited with a non-zero status (named in the message) and the run
    stopped."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_argv(
    job: JobConfig,
    index: int,
    coordinator: str,
    address: str,
    token_file: Path,
    model: Path,
    result: Path,
) -> list[str]:
    """``python -m trainer.launch.trainer_worker ...`` of trainer process `index` (with
    ``launch.stop_joined=false``: the launcher, not its process 0, ends a joined gateway)."""
    run_dir = job.run_dir.absolute()
    return [
        sys.executable, "-m", "trainer.launch.trainer_worker",
        "--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir),
        "--process-id", str(index), "--num-processes", str(job.launch.trainer_processes),
        "--coordinator", coordinator, "--gateway", address, "--token-file", str(token_file),
        "--model", str(model), "--result", str(result), "launch.stop_joined=false",
    ]  # fmt: skip


def worker_env(job: JobConfig, index: int, base: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of trainer process `index`: `base`, unbuffered output, and its
    devices (GPU: its own `launch.trainer_devices` CUDA ids after the engines'; CPU: the CPU
    platform; `trainer.distributed` sets the host device count and gloo)."""
    launch = job.launch
    env = {k: v for k, v in base.items() if k != "XLA_FLAGS"}
    env["PYTHONUNBUFFERED"] = "1"
    if resolve_accelerator(job) == "gpu":
        first = launch.num_engines * launch.devices_per_engine + index * launch.trainer_devices
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            str(i) for i in range(first, first + launch.trainer_devices)
        )
        env.pop("JAX_PLATFORMS", None)
    else:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def run_trainer_processes(
    job: JobConfig,
    procs: ProcessSet,
    client: Any,
    address: str,
    token_file: Path,
    model_path: Path,
) -> dict[str, Any]:
    """Start the P trainer processes, wait for them (see the module docstring) and return
    process 0's result (the job summary's fields).

    Raises:
      TrainerProcessLost: a trainer process exited non-zero (names it and the others' fate).
      RuntimeError: fewer than launch.min_engines engines serve; process 0 wrote no result.
      KeyboardInterrupt: a second SIGINT/SIGTERM (a forced stop).
    """
    from trainer.launch.supervisor import EngineSupervisor, deregister_dead

    launch, run_dir = job.launch, job.run_dir.absolute()
    result_path = run_dir / "trainer_result.json"
    result_path.unlink(missing_ok=True)
    coordinator = f"127.0.0.1:{free_port()}"
    names = [NAME.format(i) for i in range(launch.trainer_processes)]
    supervisor = None
    try:
        for i, name in enumerate(names):
            argv = worker_argv(job, i, coordinator, address, token_file, model_path, result_path)
            procs.start(name, argv, worker_env(job, i, os.environ), inherit_output=i == 0)
        if not launch.gateway:
            supervisor = EngineSupervisor(
                procs, [f"engine{i}" for i in range(launch.num_engines)],
                restart=launch.restart_engines, max_restarts=launch.max_restarts,
                backoff_s=launch.restart_backoff_s, backoff_max_s=launch.restart_backoff_max_s,
                min_engines=launch.min_engines, on_death=deregister_dead(client),
            ).start()  # fmt: skip
        with interrupt.graceful():
            _wait(procs, names, supervisor, launch.min_engines)
    finally:
        if supervisor is not None:
            supervisor.stop()
    if not result_path.exists():
        raise RuntimeError(f"trainer process 0 exited with status 0 but wrote no {result_path}")
    result = json.loads(result_path.read_text())
    if interrupt.requested():  # process 0 got SIGINT whatever the launcher got
        result["stop_reason"], result["exit_code"] = interrupt.requested(), interrupt.exit_code()
    result["trainer_processes"] = launch.trainer_processes
    # the engines are the launcher's children here: its supervisor restarted them, not process 0
    result["engine_restarts"] = dict(supervisor.restarts) if supervisor is not None else {}
    return dict(result)


def _wait(procs: ProcessSet, names: list[str], supervisor: Any, min_engines: int) -> None:
    """Until every trainer process exited 0; raises as `run_trainer_processes`."""
    forwarded = False
    while True:
        codes = {name: procs.child(name).proc.poll() for name in names}
        failed = [n for n, c in codes.items() if c not in (None, 0)]
        if failed:
            _lost(procs, names, failed)
        if all(c == 0 for c in codes.values()):
            return
        if not forwarded and interrupt.requested():
            forwarded = True  # process 0 stops gracefully and tells the others
            os.kill(procs.child(names[0]).proc.pid, signal.SIGINT)  # SIGTERM: stop now
        if supervisor is not None and supervisor.serving() < min_engines:
            supervisor.check()  # raises, naming the dead engines
        time.sleep(POLL_S)


def _lost(procs: ProcessSet, names: list[str], failed: list[str]) -> None:
    """Raise `TrainerProcessLost` for the first failed process (the one that took the others
    down: a SIGKILL or a crash wins over the abort JAX gives the survivors)."""
    by_kill = [n for n in failed if procs.child(n).proc.returncode != -signal.SIGABRT]
    name = (by_kill or failed)[0]
    child = procs.child(name)
    index = names.index(name)
    code = int(child.proc.returncode)
    time.sleep(2.0)  # JAX ends the survivors about a second after a peer died
    others = {
        n: "still running" if (c := procs.child(n).proc.poll()) is None else _describe(c)
        for n in names
        if n != name
    }
    tail = "" if index == 0 else f"; last lines of {child.log_path}:\n{child.tail()}"
    raise TrainerProcessLost(
        f"trainer process {index} (pid {child.proc.pid}) was lost: {_describe(code)}; the "
        f"other trainer processes: {others}; stopping every process of the job{tail}"
    )
