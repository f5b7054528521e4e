"""The trainer as P processes under JAX's multi-controller runtime (`jax.distributed`).

Every trainer process runs the same program; together they see one global device list, and
one ("dp", "fsdp", "tp") mesh spans all of it (`models.sharding.mesh_devices`, `make_mesh`).

Two ways in:
- One machine (the launcher's CI path, one process per GPU on a multi-GPU node): an explicit
  coordinator ``127.0.0.1:PORT``, process count P and process id, with `local_devices` CPU
  devices per process (``launch.trainer_devices``).
- A cluster: every host runs the same command with no coordinator; `jax.distributed.initialize`
  takes coordinator, count and id from the environment it detects (Slurm, Open MPI, TPU pods,
  GKE; `cluster_detection_method` picks one).

On CPU the cross-process collectives need gloo (``jax_cpu_collectives_implementation``) and
the host device count (``jax_num_cpu_devices``, which wins over ``XLA_FLAGS``); both are set
here before JAX's backend starts.

Faults: joining is bounded by `init_timeout_s`. JAX itself does not raise when the group does
not form: its client aborts the process (SIGABRT, "DEADLINE_EXCEEDED ... RegisterTask", no
address: observed), and while it waits it holds the interpreter, so no Python timer can
run (observed: a `threading.Timer` never fired). So the process first prints one line naming
the coordinator, this process, the count and the deadline to stderr, then arms
`faulthandler.dump_traceback_later` (a C watchdog thread that needs no interpreter): at the
deadline it dumps the stack ("Timeout (0:00:08)!", inside `jax.distributed.initialize`) and
exits the process with `EXIT_INIT_TIMEOUT` (1, the code faulthandler exits with); JAX's own
deadline is set `INIT_GRACE_S` later. Errors JAX does raise (a
bad address) become `DistributedInitError`. After the join, JAX's coordination service watches
heartbeats. When process 0 (the coordinator) dies, the others are terminated by JAX at once
("the leader task was preempted/died"). When another process dies, the service
notices after `heartbeat_timeout_s` without its heartbeat and terminates the rest with "The
following tasks are unhealthy (stopped sending heartbeats): K" (observed with a SIGKILL of one
of two CPU processes at a short timeout; at the default the survivor may instead fail at the
next barrier it reaches). The launcher does not wait for either: it sees a trainer process
exit and stops the job (`trainer.launch.trainer_processes`). The timeout defaults to JAX's
100 s: a short timeout has made the service declare both live processes of a loaded host
dead at once (a stall of the whole host) and abort a healthy job; a short timeout trades a
hung process found sooner for healthy jobs killed under load. A survivor never waits in a
collective for a peer that is gone.
(JAX's "recoverable" mode would let the survivor live on, and it then hangs in the next gloo
collective: observed; it is not used.)
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import sys

import jax

#: Exit status of a process whose group did not form within `ProcessGroup.init_timeout_s`
#: (faulthandler's watchdog exits with 1).
EXIT_INIT_TIMEOUT = 1
#: Seconds JAX's own join deadline (which aborts the process) runs past ours.
INIT_GRACE_S = 30


class DistributedInitError(RuntimeError):
    """The process could not join the `jax.distributed` group in time (names the coordinator,
    the process id and the count)."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """How this trainer process joins the others.

    Attributes:
      num_processes: P; 1 (the default) means a single process and no `jax.distributed`;
        None on a cluster means "take it from the environment".
      process_id: this process, 0..P-1 (None: from the environment).
      coordinator: ``host:port`` of process 0's coordination service (None: from the
        environment); on one machine ``127.0.0.1:PORT`` with a free port.
      local_devices: on CPU, the host devices of this process (``jax_num_cpu_devices``);
        None keeps the platform's count. Ignored on GPU/TPU (their devices are physical).
      platform: "cpu" sets gloo collectives and `local_devices`; other values set nothing.
      cluster_detection_method: passed to `jax.distributed.initialize` ("slurm", "ompi",
        "mpi4py", ...); None lets JAX try its detectors.
      init_timeout_s: seconds to wait for every process to join (whole seconds).
      heartbeat_timeout_s: seconds without a heartbeat after which a process counts as dead
        (JAX's default, 100); how soon a lost process other than 0 is found.
      shutdown_timeout_s: seconds a finishing process waits for the others at the shutdown
        barrier.
    """

    num_processes: int | None = 1
    process_id: int | None = None
    coordinator: str | None = None
    local_devices: int | None = None
    platform: str = "cpu"
    cluster_detection_method: str | None = None
    init_timeout_s: int = 120
    heartbeat_timeout_s: int = 100
    shutdown_timeout_s: int = 60

    @property
    def multi_process(self) -> bool:
        """True unless this is explicitly one process."""
        return self.num_processes != 1

    def validate(self) -> None:
        """Raises ValueError for an impossible combination (named)."""
        n, i = self.num_processes, self.process_id
        if n is not None and n < 1:
            raise ValueError(f"num_processes must be >= 1; got {n}")
        if n is not None and i is not None and not 0 <= i < n:
            raise ValueError(f"process_id must be in [0, {n}); got {i}")
        if self.local_devices is not None and self.local_devices < 1:
            raise ValueError(f"local_devices must be >= 1; got {self.local_devices}")
        for name in ("init_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 s; got {getattr(self, name)}")


def configure_platform(group: ProcessGroup) -> None:
    """Before JAX's backend starts: gloo CPU collectives (multi-process only) and the CPU
    device count of this process. Raises RuntimeError if the backend already started (the
    settings would be ignored silently otherwise)."""
    if group.platform != "cpu":
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "configure the trainer's processes before any JAX computation: the backend "
            "already started, so the CPU device count and collectives would be ignored"
        )
    if group.multi_process:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if group.local_devices is not None:
        jax.config.update("jax_num_cpu_devices", int(group.local_devices))


def initialize(group: ProcessGroup) -> tuple[int, int]:
    """Configure the platform and join the group; returns (process_index, process_count).

    A single process (``num_processes == 1``) only configures the platform.

    It first prints "trainer process I of N: joining the jax.distributed group at coordinator
    HOST:PORT; ..." to stderr; if the group has not formed within `init_timeout_s` (a process
    never started, a wrong address, a port in use) the process dumps its stack and exits with
    `EXIT_INIT_TIMEOUT` (JAX would abort it later anyway, without saying where).

    Raises:
      ValueError: see `ProcessGroup.validate`.
      DistributedInitError: JAX refused the settings (names the coordinator).
    """
    group.validate()
    configure_platform(group)
    if not group.multi_process:
        return 0, 1
    where = group.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or "(from the env)"
    who = (
        f"trainer process {group.process_id} of {group.num_processes}"
        if group.process_id is not None and group.num_processes is not None
        else "a trainer process (its id and the count from the cluster environment)"
    )
    print(
        f"{who}: joining the jax.distributed group at coordinator {where}; the process exits "
        f"with status {EXIT_INIT_TIMEOUT} if it has not formed within {group.init_timeout_s:g} s "
        "(a process that never started, a wrong address, or a port in use)",
        file=sys.stderr,
        flush=True,
    )
    faulthandler.dump_traceback_later(group.init_timeout_s, exit=True)
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator,
            num_processes=group.num_processes,
            process_id=group.process_id,
            cluster_detection_method=group.cluster_detection_method,
            # process 0's coordination service listens on the coordinator's address only
            # (JAX's default is every interface, [::]:PORT)
            coordinator_bind_address=group.coordinator,
            initialization_timeout=int(group.init_timeout_s) + INIT_GRACE_S,
            heartbeat_timeout_seconds=int(group.heartbeat_timeout_s),
            shutdown_timeout_seconds=int(group.shutdown_timeout_s),
        )
    except Exception as exc:  # jaxlib raises XlaRuntimeError / ValueError / RuntimeError
        raise DistributedInitError(
            f"{who} could not join the jax.distributed group at coordinator {where}: {exc}"
        ) from exc
    finally:
        faulthandler.cancel_dump_traceback_later()
    return jax.process_index(), jax.process_count()


def shutdown() -> None:
    """Leave the group (waits at JAX's shutdown barrier, at most `shutdown_timeout_s`); a no-op
    for a single process."""
    if jax.process_count() > 1:
        jax.distributed.shutdown()
