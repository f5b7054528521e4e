"""The run folder's per-step logs (``metrics.jsonl``, ``groups.jsonl``) kept in step with the
checkpoint a run resumes from: rows written after it (by steps that a stop lost) are dropped
before the resumed run writes those steps again, so each step appears once. And the attempt
counter (``attempts.txt``): every start of a job in the folder gets a new attempt number, which
tags its sample ids (`trainer.rollout_source`), even when two starts resume the same checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

STEP_LOGS = ("metrics.jsonl", "groups.jsonl")


def keep_rows_up_to(path: str | Path, step: int) -> int:
    """Rewrite the JSONL file `path` keeping only rows whose ``"step"`` is <= `step`; rows
    without one are kept, an unparsable line (torn by a kill mid-write) is dropped. The
    rewrite goes through a temporary file and a rename, so a crash leaves either file whole. Returns
    the number of rows dropped (0 also when the file does not exist).
    """
    file = Path(path)
    if not file.exists():
        return 0
    kept, dropped = [], 0
    for line in file.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a kill mid-write
            dropped += 1
            continue
        if isinstance(row, dict) and int(row.get("step", step)) > step:
            dropped += 1
        else:
            kept.append(line + "\n")
    if dropped:
        tmp = file.with_name(file.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, file)
    return dropped


def truncate_step_logs(run_dir: str | Path, step: int) -> dict[str, int]:
    """`keep_rows_up_to` on each of ``metrics.jsonl`` and ``groups.jsonl`` of `run_dir`;
    returns the rows dropped per file name."""
    return {name: keep_rows_up_to(Path(run_dir) / name, step) for name in STEP_LOGS}


def next_attempt(run_dir: str | Path, at_least: int = 0) -> int:
    """Count one more start of a job in `run_dir` and return its attempt number: one more than
    the last one recorded in ``run_dir/attempts.txt`` (0 for the first), and at least
    `at_least` (e.g. the restored checkpoint's attempt + 1). The folder must exist.
    """
    file = Path(run_dir) / "attempts.txt"
    text = file.read_text().strip() if file.exists() else ""
    attempt = max(int(text) + 1 if text.isdigit() else 0, at_least)
    file.write_text(f"{attempt}\n")
    return attempt
