"""A child's tie to the launcher that started it: the child ends when the launcher dies,
whatever killed the launcher (SIGKILL included).

Two halves, both Linux-only (elsewhere they do nothing):
- the launcher's side, `death_signal_preexec(launcher_pid)`: a `preexec_fn` for `Popen` that
  sets ``PR_SET_PDEATHSIG`` to SIGTERM in the child between fork and exec (so the kernel sends
  SIGTERM the moment the launcher's spawning thread dies; ``exec`` keeps it, ``taskset``
  execs, so it reaches the program) and exits the child at once when the launcher already
  died before that point;
- the child's side, `hold_to_launcher()`, which each entry point the launcher starts calls
  first (``python -m gateway serve``, ``python -m rollout_engine``, the trainer worker). It
  reads `LAUNCHER_PID_ENV` (set by the launcher) and, from a daemon thread, waits on a pidfd
  of that process (no pid reuse race: the pidfd names that very process); once the launcher is
  gone it waits `grace_s` seconds for the graceful stop SIGTERM started, then SIGKILLs its
  process group when that group is the session the launcher started it in (the child, a
  wrapper, and what they started, such as vLLM's engine core), else itself. This also covers
  the cases PDEATHSIG cannot: a wrapper process between launcher and child (PDEATHSIG then
  ties the child to the wrapper), a child started from a thread of the launcher that ends
  before the launcher does (PDEATHSIG follows the thread), a set-user-ID wrapper (it clears
  PDEATHSIG).

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
#: Seconds a child whose launcher died has to stop by itself before it SIGKILLs its group.
GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1
_PR_GET_PDEATHSIG = 2


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None off Linux / without libc."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        return ctypes.CDLL(name, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def death_signal_preexec(
    launcher_pid: int, sig: signal.Signals = signal.SIGTERM
) -> Callable[[], None] | None:
    """A `Popen(preexec_fn=...)` that makes the child receive `sig` when the launcher's
    spawning thread dies (``PR_SET_PDEATHSIG``) and exits the child with status 1 when the
    launcher `launcher_pid` already died after the fork. Returns None where prctl is missing.
    libc is resolved here, in the launcher, so the child runs no loader code after the fork."""
    prctl = _prctl()
    if prctl is None:
        return None
    signum = int(sig)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != launcher_pid:  # the launcher died between fork and prctl
            os._exit(1)

    return preexec


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
    # the kernel sends SIGTERM itself when the launcher is the parent and set PDEATHSIG
    kernel_sends = os.getppid() == pid and _death_signal() != 0
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


def _death_signal() -> int:
    """This process's PDEATHSIG (0: none, or unknown)."""
    prctl = _prctl()
    if prctl is None:
        return 0
    out = ctypes.c_int(0)
    if prctl(_PR_GET_PDEATHSIG, ctypes.byref(out), 0, 0, 0) != 0:
        return 0
    return int(out.value)


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
