"""What the integration tests that start real processes share: the repository root, the
environment of a child they start (a job, an engine), the smoke job's command line, and the
rows of a run's JSONL files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from deploy.local.hosts_job import child_env as hosts_child_env

REPO = Path(__file__).resolve().parents[2]


def child_env(tmp_path: Path | None = None, drop: tuple[str, ...] = (), **extra: str) -> dict:
    """This process's environment for a child (`deploy.local.hosts_job.child_env`): without
    XLA_FLAGS (the test process forces 8 host devices; a launcher gives each of its children
    its own count), on CPU, with the model cache (`JAXRL_CACHE_DIR`) in ``tmp_path/cache`` when
    given, without the `drop` names, plus `extra`."""
    return hosts_child_env(tmp_path / "cache" if tmp_path is not None else None, drop, **extra)


def smoke_command(run_dir: Path, *overrides: str) -> list[str]:
    """``python -m trainer train`` on configs/smoke.yaml into `run_dir`, no progress bar, then
    the `overrides` (``key=value``)."""
    return [
        sys.executable, "-m", "trainer", "train", "--config", "configs/smoke.yaml",
        f"run_dir={run_dir}", "launch.progress=false", *overrides,
    ]  # fmt: skip


def jsonl_rows(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file (metrics.jsonl, groups.jsonl, eval files), in order."""
    return [json.loads(line) for line in path.read_text().splitlines()]
