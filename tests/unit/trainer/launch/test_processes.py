"""Child processes: own process groups, SIGTERM then SIGKILL, grandchildren too."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from trainer.launch.processes import ProcessSet

# A child that ignores SIGTERM and starts a grandchild in its own group (as vLLM's engine core).
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_stop_all_kills_stubborn_child_and_grandchild(tmp_path):
    procs = ProcessSet(tmp_path, timeout_s=0.5)
    child = procs.start("stubborn", [sys.executable, "-c", STUBBORN], os.environ)
    deadline = time.monotonic() + 30
    while not child.log_path.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(child.log_path.read_text().split()[0])
    assert os.getpgid(child.proc.pid) == child.proc.pid  # its own group
    t0 = time.monotonic()
    codes = procs.stop_all()
    assert codes == {"stubborn": -signal.SIGKILL}
    assert 0.5 <= time.monotonic() - t0 < 10
    time.sleep(0.2)
    assert not _alive(grandchild)
    assert procs.stop_all() == codes  # idempotent


def test_polite_child_ends_on_sigterm_and_exit_is_reported(tmp_path):
    with ProcessSet(tmp_path, timeout_s=10) as procs:
        procs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], os.environ)
        procs.start("quitter", [sys.executable, "-c", "print('bye'); raise SystemExit(3)"],
                    os.environ)  # fmt: skip
        procs.children[1].proc.wait(30)
        with pytest.raises(RuntimeError, match=r"quitter exited with status 3(.|\n)*bye"):
            procs.check_alive()
        assert procs.stop_all() == {"sleeper": -signal.SIGTERM, "quitter": 3}
    with pytest.raises(ValueError, match="already exists"):
        procs.start("sleeper", ["true"], os.environ)
