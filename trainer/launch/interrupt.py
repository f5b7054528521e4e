"""Ctrl-C and SIGTERM for the launcher, prompt even while the main thread sits in a long XLA call.

Python runs signal handlers in the main thread between bytecodes, so a signal that arrives during
a train step (minutes for a real model on a CPU) would wait for it. `install` therefore does two
things: the handler raises `KeyboardInterrupt` in the main thread (the normal path: every
`ProcessSet` stops its children on the way out), and a watcher thread, woken through
`signal.set_wakeup_fd` (written by the C-level handler at once), gives the main thread `grace_s`
seconds to begin stopping its children; if no `ProcessSet` began by then, the watcher stops every
one itself and ends the process with status 130.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from trainer.launch.processes import live_sets

EXIT_INTERRUPTED = 130


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _watch(read_fd: int, grace_s: float) -> None:
    os.read(read_fd, 1)  # blocks until the first signal
    time.sleep(grace_s)
    if any(p.stopping for p in live_sets()):
        return  # the main thread is on its way out
    sys.stderr.write(f"\nthe trainer is busy after {grace_s:.0f} s: stopping every process now\n")
    for procs in live_sets():
        procs.stop_all()
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def install(grace_s: float = 10.0) -> None:
    """Route SIGINT and SIGTERM as described in the module docstring (call from the main
    thread, once).

    Raises:
      ValueError: `grace_s` <= 0, or not called from the main thread (from `signal`).
    """
    if grace_s <= 0:
        raise ValueError(f"grace_s must be > 0; got {grace_s}")
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_interrupt)
    threading.Thread(target=_watch, args=(read_fd, grace_s), name="interrupt", daemon=True).start()
