"""The run folder's per-step logs (``metrics.jsonl``, ``groups.jsonl``) kept in step with the
checkpoint a run resumes from: rows written after it (by steps that a stop lost) are dropped
before the resumed run writes those steps again, so each step appears once.
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
