"""Child processes of the launcher, each in its own process group, stopped with no orphans.

`ProcessSet.start` runs a command in a new session (its own process group), its stdout and
stderr appended to a log file. No child outlives the launcher, whatever kills it: each gets
the launcher's pid in ``JAXRL_LAUNCHER_PID`` (and, started from the main thread, leave to
take SIGTERM as its PR_SET_PDEATHSIG); the entry points hold to it (`gateway.lifeline`).
`ProcessSet.stop_all` sends SIGTERM to every group, waits up to
`timeout_s`, then SIGKILLs the groups still alive, so a child's own children (vLLM's engine core
and workers) go too. It is idempotent and runs from `__exit__`, so an exception or Ctrl-C in
the launcher stops every child. `live_sets` lists the sets of this process (for
`trainer.launch.interrupt`). `ProcessSet.restart` starts a dead child again with the same
command and environment (the supervisor of `trainer.launch.supervisor` does it for engines).
Thread-safe: a supervisor thread may restart a child while the main thread stops them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from gateway.lifeline import LAUNCHER_PID_ENV, PDEATHSIG_ENV

log = logging.getLogger(__name__)

#: What `ProcessSet.stop_all` writes into the log folder: each child's exit status.
STOPPED_FILE = "stopped.json"


@dataclasses.dataclass
class Child:
    """One started process: its name, `Popen`, log file, command and environment, and how
    many times it was restarted."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    _log_file: IO[bytes]
    argv: tuple[str, ...] = ()
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    restarts: int = 0

    def alive(self) -> bool:
        """True while the process has not exited."""
        return self.proc.poll() is None

    def tail(self, lines: int = 20) -> str:
        """The last `lines` lines of its log (for error messages)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class ProcessSet:
    """The launcher's children.

    Args:
      log_dir: folder of the ``NAME.log`` files (created).
      timeout_s: seconds between SIGTERM and SIGKILL in `stop_all` (> 0).
    """

    def __init__(self, log_dir: str | Path, timeout_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0; got {timeout_s}")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.children: list[Child] = []
        self.stopping = False
        self._sigkilled: list[str] = []
        self._lock = threading.RLock()
        _LIVE.add(self)

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str], inherit_output: bool = False
    ) -> Child:
        """Start `argv` with exactly the environment `env` in a new process group; its stdout
        and stderr go to ``NAME.log``, or with `inherit_output` to this process's own (a
        progress bar the user must see; the log file then stays empty).

        Raises:
          ValueError: a name already used; OSError: the program cannot be started.
        """
        with self._lock:
            if any(c.name == name for c in self.children):
                raise ValueError(f"a child named {name!r} already exists")
            child = self._spawn(name, tuple(argv), dict(env), inherit_output)
            self.children.append(child)
            return child

    def _spawn(
        self, name: str, argv: tuple[str, ...], env: dict[str, str], inherit: bool = False
    ) -> Child:
        path = self.log_dir / f"{name}.log"
        log_file = path.open("ab")
        # PDEATHSIG follows the spawning thread: only the main thread's children take it (a
        # supervisor thread ends before the launcher); the child's lifeline covers the rest
        tie = {LAUNCHER_PID_ENV: str(os.getpid())}
        if threading.current_thread() is threading.main_thread():
            tie[PDEATHSIG_ENV] = "1"
        proc = subprocess.Popen(
            list(argv),
            env={**env, **tie},
            stdin=subprocess.DEVNULL,
            stdout=None if inherit else log_file,
            stderr=None if inherit else subprocess.STDOUT,
            start_new_session=True,
        )
        log.info("started %s (pid %d), log %s", name, proc.pid, path)
        return Child(name, proc, path, log_file, argv, env)

    def child(self, name: str) -> Child:
        """The child named `name`.

        Raises:
          KeyError: no such child.
        """
        with self._lock:
            for c in self.children:
                if c.name == name:
                    return c
        raise KeyError(f"no child named {name!r}; known: {[c.name for c in self.children]}")

    def restart(self, name: str) -> Child | None:
        """Start the exited child `name` again (same command, environment and log file,
        appended); returns the new child, or None once `stop_all` began.

        Raises:
          KeyError: no such child; RuntimeError: it is still running; OSError: cannot start.
        """
        with self._lock:
            if self.stopping:
                return None
            old = self.child(name)
            if old.alive():
                raise RuntimeError(f"{name} (pid {old.proc.pid}) is still running")
            _signal_group(old.proc.pid, signal.SIGKILL)  # what is left of its group
            old._log_file.close()
            new = self._spawn(name, old.argv, old.env)
            new.restarts = old.restarts + 1
            self.children[self.children.index(old)] = new
            return new

    def check_alive(self) -> None:
        """Raise if a child exited.

        Raises:
          RuntimeError: names the child, its exit status and its log's last lines.
        """
        for child in self.children:
            code = child.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"{child.name} exited with status {code}; last lines of {child.log_path}:\n"
                    f"{child.tail()}"
                )

    def wait_all(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` seconds for every child to exit by itself; True if all did."""
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(max(0.0, deadline - time.monotonic()))
        return not any(c.alive() for c in self.children)

    def stop_all(self) -> dict[str, int]:
        """SIGTERM every child's group, SIGKILL those alive after `timeout_s`; returns each
        child's exit status (negative: the signal that ended it). Also writes them to
        ``LOG_DIR/stopped.json`` (`STOPPED_FILE`: ``exit_codes``, and
        ``sigkilled_after_timeout``: the children that outlived SIGTERM by `timeout_s`)."""
        with self._lock:
            return self._stop_all()

    def _stop_all(self) -> dict[str, int]:
        self.stopping = True
        for child in self.children:
            if child.alive():
                _signal_group(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.timeout_s
        for child in self.children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._sigkilled.append(child.name)
                log.warning("%s ignored SIGTERM for %.0f s: SIGKILL", child.name, self.timeout_s)
        for child in self.children:
            # the group may outlive its leader (vLLM's engine core): kill what is left of it
            _signal_group(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
            if not child._log_file.closed:
                child._log_file.close()
        codes = {c.name: int(c.proc.returncode) for c in self.children}
        record = {"exit_codes": codes, "sigkilled_after_timeout": self._sigkilled}
        with contextlib.suppress(OSError):
            (self.log_dir / STOPPED_FILE).write_text(json.dumps(record, indent=2) + "\n")
        return codes

    def __enter__(self) -> ProcessSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


_LIVE: weakref.WeakSet[ProcessSet] = weakref.WeakSet()


def live_sets() -> list[ProcessSet]:
    """Every `ProcessSet` of this process that is not garbage yet."""
    return list(_LIVE)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
