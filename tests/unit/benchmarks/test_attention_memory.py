"""`benchmarks/attention_memory.py` as a user runs it: its last line is one JSON object whose
planned temporary bytes show the blockwise attention's memory growing linearly where the dense
path's grows with T² (bytes are XLA's compiled plan, not a timing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "attention_memory.py"


def test_blockwise_bytes_grow_linearly_where_dense_bytes_grow_quadratically():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--lengths", "512", "1024", "--block", "128",
         "--rows", "1", "--repeats", "1"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    last = json.loads(out.strip().splitlines()[-1])
    assert last["block"] == 128 and last["rows"] == 1
    short, long = last["lengths"]["512"], last["lengths"]["1024"]
    for row in (short, long):
        assert row["temp_bytes_blockwise_over_dense"] == (
            row["blockwise_temp_bytes"] / row["dense_temp_bytes"]
        )
        assert row["dense_seconds"] > 0 and row["blockwise_seconds"] > 0
    # doubling T: the dense scores quadruple (at least 3.5x), the blockwise ones about double
    assert long["dense_temp_bytes"] >= 3.5 * short["dense_temp_bytes"]
    assert long["blockwise_temp_bytes"] <= 2.5 * short["blockwise_temp_bytes"]
    assert long["temp_bytes_blockwise_over_dense"] < 0.5
