"""`scripts/setup.sh` says what it is doing: a line on stderr before each long step (the first
install takes minutes), and a second run says the packages are up to date."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "setup.sh"


def test_every_install_step_is_announced():
    lines = [ln.strip() for ln in SCRIPT.read_text().splitlines()]
    code = [ln for ln in lines if ln and not ln.startswith("#")]
    steps = [i for i, ln in enumerate(code) if 'pip" install' in ln or "-m venv" in ln]
    assert [code[i - 1].split('"')[0] for i in steps] == ["say "] * 4, [code[i] for i in steps]


def test_second_run_says_it_is_up_to_date(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + SCRIPT.read_bytes())
    (venv / ".jaxrl-setup-stamp").write_text(digest.hexdigest() + "\n")
    env = dict(os.environ, VENV=str(venv), JAXRL_SKIP_MODEL="1")
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"setup: packages up to date in {venv} (stamp {venv}/.jaxrl-setup-stamp)",
        "setup: done",
    ]
