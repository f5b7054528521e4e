"""A real Slurm in a cluster in a box: slurmctld on one namespace host, a slurmd on each of the
others, from Debian's slurm-wlm and munge, with a munge key of its own.

Everything lives in one folder (`SlurmBox.root`): ``slurm.conf`` (hand it to any Slurm command
as ``SLURM_CONF``), the munge key and socket, the controller's state, each slurmd's spool and
the logs. The daemons run on the box's hosts (`deploy.local.cluster_box`), so each slurmd has
its own hostname and address and every ``srun`` step it starts runs on that host. Accounting
(``sacct``) needs slurmdbd and a MySQL server; this box keeps the controller's job-completion
log instead (``jobcomp/filetxt``, `SlurmBox.completed`), which records the same final state.

Limits: proctrack/pgid and task/none (no cgroups), CPUs only (no GRES), root as SlurmUser.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from deploy.local.cluster_box import ClusterBox, ClusterBoxError

DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "scontrol")


def check_slurm() -> None:
    """Raise `ClusterBoxError` naming the Slurm or munge programs missing from PATH."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        raise ClusterBoxError(
            f"a Slurm in a box needs {', '.join(missing)} (Debian: apt-get install slurm-wlm "
            "munge; scripts/setup.sh does it as root)"
        )


class SlurmBox:
    """slurmctld on host `controller` of `box`, slurmd on each host of `nodes` (partition
    ``box``, the default), state and logs under `root`. A context manager: `start` on entry,
    `stop` on every exit.

    Args:
        box: a `ClusterBox` that is up.
        controller: the controller's host.
        nodes: the compute hosts, in order (Slurm's node list of a job follows it).
        root: an empty or new folder on a filesystem every host sees (here: this machine's).
        cpus: CPUs each node offers (Slurm counts, not cores: steps may share cores).
    """

    def __init__(
        self, box: ClusterBox, controller: str, nodes: list[str], root: Path, cpus: int = 2
    ) -> None:
        self.box, self.controller, self.nodes = box, controller, list(nodes)
        self.root = Path(root).absolute()
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket"
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> SlurmBox:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def env(self) -> dict[str, str]:
        """Variables every Slurm command of this box needs (``SLURM_CONF``)."""
        return {"SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        box = self.box
        nodes = "".join(
            f"NodeName={n} NodeAddr={box.address(n)} CPUs={self.cpus} RealMemory=1000 "
            "State=UNKNOWN\n"
            for n in self.nodes
        )
        self.conf.write_text(
            f"ClusterName=box\n"
            f"SlurmctldHost={self.controller}({box.address(self.controller)})\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            "AuthType=auth/munge\nCredType=cred/munge\n"
            f"AuthInfo=socket={self.socket}\n"
            f"StateSaveLocation={self.root}/state\n"
            f"SlurmdSpoolDir={self.root}/spool/%n\n"
            f"SlurmctldPidFile={self.root}/slurmctld.pid\n"
            f"SlurmdPidFile={self.root}/slurmd-%n.pid\n"
            f"SlurmctldLogFile={self.root}/logs/slurmctld.log\n"
            f"SlurmdLogFile={self.root}/logs/slurmd-%n.log\n"
            "SlurmctldPort=6817\nSlurmdPort=6818\n"
            "ProctrackType=proctrack/pgid\nTaskPlugin=task/none\n"
            "MpiDefault=none\nReturnToService=2\n"
            "SchedulerType=sched/backfill\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
            "AccountingStorageType=accounting_storage/none\n"
            "JobAcctGatherType=jobacct_gather/none\n"
            f"JobCompType=jobcomp/filetxt\nJobCompLoc={self.root}/jobcomp.log\n"
            "MinJobAge=3600\nSlurmdTimeout=60\nSlurmctldTimeout=60\nKillWait=10\n"
            f"{nodes}"
            f"PartitionName=box Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=FORCE:4\n"
        )

    def start(self, timeout_s: float = 60) -> None:
        """Make the key, the config and the folders; start munged, slurmctld and every slurmd;
        return once every node is idle.

        Raises:
            ClusterBoxError: a program is missing, a daemon exited, or the nodes were not
                idle within `timeout_s` (the controller's log tail in the message).
        """
        check_slurm()
        for sub in ("munge", "state", "logs", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True)
        os.chmod(key, 0o400)
        self._write_conf()
        env = {**os.environ, **self.env}
        munge = self.root / "munge"
        self._spawn(None, ["munged", "--foreground", "--force", f"--socket={self.socket}",
                           f"--key-file={key}", f"--pid-file={munge}/munged.pid",
                           f"--seed-file={munge}/munged.seed",
                           f"--log-file={self.root}/logs/munged.log"], env)  # fmt: skip
        self._wait(lambda: self.socket.exists(), timeout_s, "munged made no socket")
        self._spawn(self.controller, ["slurmctld", "-D", "-i", "-f", str(self.conf)], env)
        # `ip netns exec` mounts a fresh /sys without cgroups, and slurmd will not start
        # without its cgroup plugin: give each slurmd's mount namespace the cgroup v1 freezer
        # hierarchy and the named systemd one (the machine's own, mounted again), as a
        # host's /sys/fs/cgroup holds them
        mount = (
            "mount -t tmpfs cgroup_root /sys/fs/cgroup && "
            "mkdir -p /sys/fs/cgroup/freezer /sys/fs/cgroup/systemd && "
            "mount -t cgroup -o freezer freezer /sys/fs/cgroup/freezer && "
            "mount -t cgroup -o none,name=systemd systemd /sys/fs/cgroup/systemd && "
            'exec "$@"'
        )
        for node in self.nodes:
            argv = ["slurmd", "-D", "-N", node, "-f", str(self.conf)]
            self._spawn(node, ["sh", "-c", mount, "slurmd", *argv], env)
        self._wait(self._all_idle, timeout_s, "the nodes were not idle")

    def _spawn(self, host: str | None, argv: list[str], env: Mapping[str, str]) -> None:
        name = Path(argv[3] if argv[0] == "sh" else argv[0]).name
        log = (self.root / "logs" / f"{name}-{host or 'local'}.out").open("ab")
        with log:
            if host is None:
                proc = subprocess.Popen(argv, env=dict(env), stdout=log, stderr=log)
            else:
                proc = self.box.popen(host, argv, env=env, stdout=log, stderr=log)
        self._procs.append(proc)

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for proc in self._procs:
                if proc.poll() is not None:
                    raise ClusterBoxError(
                        f"{proc.args!r} exited with {proc.returncode}; {self._log_tail()}"
                    )
            if time.monotonic() > deadline:
                raise ClusterBoxError(f"{what} within {timeout_s} s; {self._log_tail()}")
            time.sleep(0.25)

    def _log_tail(self) -> str:
        logs = sorted((self.root / "logs").glob("*"))
        return " | ".join(f"{p.name}: {p.read_text(errors='replace')[-600:]}" for p in logs)

    def _all_idle(self) -> bool:
        out = self.command(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
        return all(states.get(n) == "idle" for n in self.nodes)

    def command(self, argv: list[str], check: bool = True, env: Mapping[str, str] = {}) -> str:
        """Run a Slurm client command (sbatch, scontrol, sinfo, ...) on the controller's host;
        returns its stdout.

        Raises:
            ClusterBoxError: it exited non-zero (with `check`).
        """
        return self.box.run(
            self.controller, argv, check=check, env={**os.environ, **self.env, **env}
        )

    def sbatch(self, script: Path, args: list[str], env: Mapping[str, str], cwd: Path) -> int:
        """Submit `script` (sbatch `args` first) with `env` added to this process's
        environment; returns the job id."""
        out = self.box.run(
            self.controller, ["sbatch", "--parsable", *args, str(script)],
            env={**os.environ, **self.env, **env}, cwd=cwd,
        )  # fmt: skip
        return int(out.strip().split(";")[0])

    def job_state(self, job_id: int) -> tuple[str, str]:
        """(JobState, ExitCode) of a job as the controller reports it, e.g. ("COMPLETED", "0:0")."""
        out = self.command(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        state = re.search(r"JobState=(\S+)", out)
        code = re.search(r"ExitCode=(\S+)", out)
        return (state.group(1) if state else "UNKNOWN", code.group(1) if code else "")

    def completed(self) -> list[dict[str, str]]:
        """The job-completion log: one dict per finished job (JobId, JobState, NodeList, ...)."""
        path = self.root / "jobcomp.log"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            rows.append(dict(re.findall(r"(\w+)=(\S*)", line)))
        return rows

    def stop(self) -> None:
        """Stop every daemon (SIGTERM, then SIGKILL after 10 s); the jobs' processes go with
        the box's hosts (`ClusterBox.down`)."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
