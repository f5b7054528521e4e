"""Issue 25 item 1: no child outlives a launcher that dies, whatever killed it.

A real launcher process (a `ProcessSet` in a small Python program) starts children, prints
their pids and is SIGKILLed (no Python code runs in it, no `stop_all`); every child and the
grandchild must be gone within a bounded wait:
- a child started from the launcher's main thread dies by the kernel's PDEATHSIG (SIGTERM);
- a child that ignores SIGTERM, behind a shell wrapper that forks (so PDEATHSIG only ties it
  to the wrapper), with a grandchild in its process group, is ended by its own lifeline
  (`gateway.lifeline.hold_to_launcher`: SIGKILL of its group after the grace);
- a child started from a thread that ended earlier (as the engine supervisor's restarts) is
  not killed by that thread's end, and still ends with the launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]

# The child: an optional grandchild in its group, its lifeline (grace 0.5 s), then sleep.
CHILD = (
    "import os, signal, subprocess, sys, time\n"
    "from gateway.lifeline import hold_to_launcher\n"
    "if 'ignore' in sys.argv: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "hold_to_launcher(grace_s=0.5)\n"
    "if 'grandchild' in sys.argv:\n"
    "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "    print('grandchild', p.pid, flush=True)\n"
    "print('child', os.getpid(), flush=True)\n"
    "time.sleep(600)\n"
)

# The launcher: starts the children named on its command line, then waits to be killed.
LAUNCHER = """
import os, shlex, sys, threading, time
from trainer.launch.processes import ProcessSet
procs = ProcessSet(sys.argv[1])
child = [sys.executable, '-c', sys.argv[2]]
procs.start('plain', child, os.environ)
wrapped = ' '.join(shlex.quote(a) for a in [*child, 'ignore', 'grandchild'])
procs.start('wrapped', ['sh', '-c', wrapped + '; true'], os.environ)
t = threading.Thread(target=procs.start, args=('threaded', child, os.environ))
t.start(); t.join()  # that thread has ended before the launcher dies
print('ready', flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _pids(log: Path) -> list[int]:
    text = log.read_text() if log.exists() else ""
    return [int(line.split()[1]) for line in text.splitlines() if line.split()[:1] in (
        ["child"], ["grandchild"])]  # fmt: skip


def test_every_child_ends_with_a_sigkilled_launcher(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), CHILD],
        env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert launcher.stdout is not None and launcher.stdout.readline() == "ready\n"
        logs = {n: tmp_path / f"{n}.log" for n in ("plain", "wrapped", "threaded")}
        deadline = time.monotonic() + 60  # a bound on a hung start, not a timing
        while [len(_pids(p)) for p in logs.values()] != [1, 2, 1]:
            assert time.monotonic() < deadline, {n: p.read_text() for n, p in logs.items()}
            time.sleep(0.05)
        pids = {n: _pids(p) for n, p in logs.items()}
        time.sleep(0.3)  # past any start-up: the thread's end killed nothing
        assert {n: [_alive(p) for p in ps] for n, ps in pids.items()} == {
            "plain": [True], "wrapped": [True, True], "threaded": [True],
        }  # fmt: skip
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        every = [p for ps in pids.values() for p in ps]
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in every) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in every if _alive(p)] == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for log in tmp_path.glob("*.log"):
            for pid in _pids(log):
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
