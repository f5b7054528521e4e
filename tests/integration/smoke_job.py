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


def assert_no_group_lost(
    loop: dict, summary: dict | None = None, groups: list[dict] | None = None
) -> int:
    """Checks a finished run's group accounting and returns how many groups were filtered.

    `loop` is the ``loop`` section of ``job_summary.json`` / ``trainer_result.json``:
    every group submitted was trained, filtered (lag, zero variance, aborted) or still in flight
    at the stop. With the job's `summary`, every in-flight group came back (waiting in the
    trainer or drained after the stop). With the run's ``groups.jsonl`` rows (`groups`), every
    trained sample id appears once and the trained rows count ``trained_groups``.

    Raises:
        AssertionError: a group lost or counted twice.
    """
    filtered = loop["filtered_lag"] + loop["filtered_zero_variance"] + loop["filtered_aborted"]
    assert loop["submitted"] == loop["trained_groups"] + filtered + loop["in_flight"], loop
    if summary is not None:
        back = summary["in_flight_waiting_in_trainer"] + summary["in_flight_drained_after_stop"]
        assert back == loop["in_flight"], (back, loop)
    if groups is not None:
        trained = [g["sample_id"] for g in groups if g["outcome"] == "trained"]
        assert len(trained) == len(set(trained)) == loop["trained_groups"], (len(trained), loop)
    return int(filtered)
