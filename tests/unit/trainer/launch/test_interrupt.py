"""The launcher's signal handling: a main thread that never gets to stop its children is
overtaken by the watcher, which stops them, runs the forced-exit hooks and exits with 130;
inside `graceful()` the first SIGINT/SIGTERM only asks for a stop (exit status 130/143)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.launch.interrupt import install

REPO = Path(__file__).resolve().parents[4]

# The main thread's handler does nothing, as one stuck in a long XLA call never gets to run it;
# the wakeup fd (written by the C-level handler) still wakes the watcher.
STUCK = """
import os, signal, sys, time
from trainer.launch.interrupt import install
from trainer.launch.processes import ProcessSet
import trainer.launch.interrupt as interrupt
install(grace_s=1.0)
interrupt.at_forced_exit(lambda: print("hook ran", flush=True))
signal.signal(signal.SIGINT, lambda *_: None)
procs = ProcessSet(sys.argv[1], timeout_s=5)
child = procs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], os.environ)
print(child.proc.pid, flush=True)
time.sleep(600)
"""


def test_watcher_stops_children_when_main_thread_is_stuck(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(proc.stdout.readline())
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        assert proc.stdout.read() == "hook ran\n"  # the job summary's hook
        assert 1.0 <= time.monotonic() - t0 < 20
    finally:
        if proc.poll() is None:
            proc.kill()
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_install_rejects_a_bad_grace():
    with pytest.raises(ValueError, match="grace_s must be > 0"):
        install(grace_s=0)


# Inside graceful(): the first SIGINT is recorded (the watcher does not kill), the second raises.
GRACEFUL = """
import os, signal, sys, time
from trainer.launch import interrupt
interrupt.install(grace_s=0.5)
with interrupt.graceful():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1.5)  # past grace_s: a watcher that wrongly acted would have ended us with 130
    print(interrupt.requested(), interrupt.exit_code(), flush=True)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        print("not raised", flush=True)
    except KeyboardInterrupt:
        print("second: KeyboardInterrupt", flush=True)
sys.stdout.flush()
os._exit(7)
"""


def test_first_signal_in_graceful_block_asks_for_a_stop_second_one_raises():
    done = subprocess.run(
        [sys.executable, "-c", GRACEFUL], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 7, done.stderr
    assert done.stdout.splitlines() == ["interrupted (SIGINT) 130", "second: KeyboardInterrupt"]
    assert "finishing the current step, then saving a checkpoint" in done.stderr


def test_sigterm_asks_for_a_stop_with_status_143():
    code = GRACEFUL.replace(
        "signal.SIGINT)\n    time.sleep(1.5)", "signal.SIGTERM)\n    time.sleep(1.5)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.splitlines()[0] == "interrupted (SIGTERM) 143", done.stderr


# A trainer process under a launcher (term_now): SIGINT inside graceful() still only asks for a
# stop; SIGTERM ends it at once with 143, though its main thread never runs the Python handler
# (it sits in a gateway retry or a collective: the handler is replaced by one doing nothing).
TERM_NOW = """
import os, signal, sys, time
from trainer.launch import interrupt
interrupt.install(grace_s=60.0, term_now=True)
with interrupt.graceful():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    print(interrupt.requested(), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: None)
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(600):
        time.sleep(0.1)
print("not stopped", flush=True)
"""


def test_term_now_sigterm_ends_a_busy_trainer_process_at_once_with_143():
    done = subprocess.run(
        [sys.executable, "-c", TERM_NOW], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout.splitlines()) == (143, ["interrupted (SIGINT)"])
    assert "SIGTERM from the launcher: this trainer process stops at once" in done.stderr
