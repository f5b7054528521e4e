"""A child's tie to the launcher that started it: the child ends when the launcher dies,
whatever killed the launcher (SIGKILL included).

The launcher (`trainer.launch.processes`) starts each child in its own session with the
environment variable `LAUNCHER_PID_ENV` (its pid) and, for a child started from its main
thread, `PDEATHSIG_ENV`. Each entry point the launcher starts calls `hold_to_launcher()` first
(``python -m gateway serve``, ``python -m rollout_engine``, the trainer worker), which:
- sets ``PR_SET_PDEATHSIG`` to SIGTERM when `PDEATHSIG_ENV` is set and its parent is still
  the launcher, so the kernel sends SIGTERM the moment the launcher dies (PDEATHSIG follows
  the thread that forked the child: a child of a launcher thread that ends earlier, as the
  engine supervisor's restarts, does not get it). It is set here, not in a ``preexec_fn``:
  Python code between fork and exec in the launcher, whose gRPC threads run, crashed the
  children (SIGSEGV, measured);
- from a daemon thread, waits on a pidfd of the launcher (no pid reuse race: the pidfd names
  that very process; a launcher already gone is acted on at once); once the launcher is gone
  it sends itself SIGTERM where PDEATHSIG did not, waits `grace_s` seconds for the graceful
  stop SIGTERM started, then SIGKILLs its process group when that group is the session the
  launcher started it in (the child, a wrapper, and what they started, such as vLLM's engine
  core), else itself. This also covers a wrapper process between launcher and child (which
  PDEATHSIG would tie the child to) and a set-user-ID wrapper (which clears PDEATHSIG).

Linux only (elsewhere `hold_to_launcher` watches nothing).
This module imports only the standard library (the gateway's start-up stays fast).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Environment variable holding the pid of the launcher a child must not outlive.
LAUNCHER_PID_ENV = "JAXRL_LAUNCHER_PID"
#: Set (to "1") by the launcher when the child may take SIGTERM as its parent-death signal.
PDEATHSIG_ENV = "JAXRL_LAUNCHER_PDEATHSIG"
#: Seconds a child whose launcher died has to stop by itself before it SIGKILLs its group.
GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None off Linux / without libc."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        return ctypes.CDLL(name, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def hold_to_launcher(grace_s: float = GRACE_S) -> threading.Thread | None:
    """End this process (and its process group when that is its session's) once the launcher
    named by `LAUNCHER_PID_ENV` is gone: SIGTERM to itself at once where no PDEATHSIG does
    it, SIGKILL after `grace_s` seconds (see the module docstring). Returns the watching
    daemon thread, or None when no launcher is named (started by hand) or the name is not a
    pid.

    Raises:
      ValueError: `grace_s` < 0.
    """
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0; got {grace_s}")
    raw = os.environ.get(LAUNCHER_PID_ENV, "")
    if not raw.isdigit() or int(raw) <= 0:
        return None
    pid = int(raw)
    kernel_sends = False  # the kernel sends SIGTERM itself when the launcher dies
    prctl = _prctl()
    if os.environ.get(PDEATHSIG_ENV) == "1" and os.getppid() == pid and prctl is not None:
        kernel_sends = prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
        if os.getppid() != pid:  # the launcher died before that: the kernel sends nothing
            kernel_sends = False
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = -1  # already gone
    thread = threading.Thread(
        target=_watch,
        args=(pid, fd, grace_s, not kernel_sends),
        name="launcher-lifeline",
        daemon=True,
    )
    thread.start()
    return thread


def _watch(pid: int, fd: int, grace_s: float, send_term: bool) -> None:
    if fd >= 0:
        select.select([fd], [], [])  # readable once the launcher exited
        os.close(fd)
    print(
        f"the launcher (pid {pid}) is gone: stopping this process (pid {os.getpid()}), "
        f"SIGKILL in {grace_s:g} s",
        file=sys.stderr,
        flush=True,
    )
    if send_term:  # else PDEATHSIG sent it (a second SIGTERM would mean "stop at once")
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    with contextlib.suppress(OSError):
        if os.getpgrp() == os.getsid(0):  # the session the launcher made: all of it goes
            os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
