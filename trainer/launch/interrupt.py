"""Ctrl-C and SIGTERM for the launcher: a graceful stop during training, a prompt one otherwise,
even while the main thread sits in a long XLA call.

Inside `graceful()` (the training loop), the first SIGINT or SIGTERM only records a stop
request: `requested()` answers its reason, the loop finishes the update under way, saves a
checkpoint and returns, and the job exits with `exit_code()` (128 + the signal: 130 for SIGINT,
143 for SIGTERM) after shutting down what it started. Outside it, or at the second signal, the
handler raises `KeyboardInterrupt` in the main thread (every `ProcessSet` stops its children on
the way out).

Python runs signal handlers in the main thread between bytecodes, so a signal that arrives
during a train step (minutes for a real model on a CPU) would wait for it. A watcher thread,
woken through `signal.set_wakeup_fd` (written by the C-level handler at once), therefore gives
the main thread `grace_s` seconds after each signal that asks for a prompt stop to begin
stopping its children; if no `ProcessSet` began by then, the watcher stops every one itself,
runs the `at_forced_exit` callbacks (the job summary) and ends the process with status 130.

A trainer process under a launcher installs with `term_now` (`trainer.launch.trainer_worker`):
its launcher passes a user's stop on as SIGINT and sends SIGTERM only when it stops every
process of the job (a lost peer, a failure), when finishing the step is impossible (the
gateway stopped, a peer's collectives are gone). Then SIGTERM ends the process at once with
status 143, from the watcher thread, even while the main thread waits in a gateway call or a
collective.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from trainer.launch.processes import live_sets

EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM

_lock = threading.Lock()
_graceful_depth = 0
_requested: str | None = None
_exit_code = 0
_term_now = False
_forced_exit_hooks: list[Callable[[], None]] = []


def at_forced_exit(hook: Callable[[], None]) -> None:
    """Run `hook` (from the watcher thread, errors ignored) before a forced exit."""
    _forced_exit_hooks.append(hook)


def requested() -> str | None:
    """The reason of a graceful stop request ("interrupted (SIGINT)"), or None."""
    return _requested


def exit_code() -> int:
    """The exit status a gracefully stopped job ends with (128 + signal), or 0 with none."""
    return _exit_code


def reset() -> None:
    """Forget a recorded stop request (a new job in the same process)."""
    global _requested, _exit_code
    _requested, _exit_code = None, 0


@contextlib.contextmanager
def graceful() -> Iterator[None]:
    """Within this block the first SIGINT/SIGTERM records a stop request instead of raising."""
    global _graceful_depth
    with _lock:
        _graceful_depth += 1
    try:
        yield
    finally:
        with _lock:
            _graceful_depth -= 1


def _wants_graceful() -> bool:
    return _graceful_depth > 0 and _requested is None


def _stop_now() -> None:
    sys.stderr.write("\nSIGTERM from the launcher: this trainer process stops at once\n")
    sys.stderr.flush()
    os._exit(EXIT_TERMINATED)


def _handler(signum: int, frame: object) -> None:
    global _requested, _exit_code
    if _term_now and signum == signal.SIGTERM:
        _stop_now()
    name = signal.Signals(signum).name
    if _wants_graceful():
        _requested, _exit_code = f"interrupted ({name})", 128 + signum
        sys.stderr.write(
            f"\n{name}: finishing the current step, then saving a checkpoint and stopping "
            f"(send it again to stop at once, without a checkpoint)\n"
        )
        sys.stderr.flush()
        return
    raise KeyboardInterrupt(f"signal {signum}")


def _watch(read_fd: int, grace_s: float) -> None:
    graceful_seen = False
    while True:
        got = os.read(read_fd, 1)  # blocks until a signal (its number, one byte)
        if _term_now and got and got[0] == signal.SIGTERM:
            _stop_now()  # the main thread may sit in a call that never returns
        if _graceful_depth > 0 and not graceful_seen:
            graceful_seen = True  # the first one inside graceful(): the loop stops by itself
            continue
        break
    time.sleep(grace_s)
    if any(p.stopping for p in live_sets()):
        return  # the main thread is on its way out
    sys.stderr.write(f"\nthe trainer is busy after {grace_s:.0f} s: stopping every process now\n")
    for procs in live_sets():
        procs.stop_all()
    for hook in _forced_exit_hooks:
        try:
            hook()
        except Exception as err:  # the exit must happen
            sys.stderr.write(f"at_forced_exit hook failed: {err}\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def install(grace_s: float = 10.0, term_now: bool = False) -> None:
    """Route SIGINT and SIGTERM as described in the module docstring (call from the main
    thread, once); with `term_now` SIGTERM ends the process at once (status 143).

    Raises:
      ValueError: `grace_s` <= 0, or not called from the main thread (from `signal`).
    """
    if grace_s <= 0:
        raise ValueError(f"grace_s must be > 0; got {grace_s}")
    global _term_now
    _term_now = term_now
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handler)
    threading.Thread(target=_watch, args=(read_fd, grace_s), name="interrupt", daemon=True).start()
