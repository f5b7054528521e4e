"""`benchmarks/multi_turn.py` on the tiny model and the JAX engine: every episode plays its 3
turns, the multi-turn pass samples exactly the single-turn pass's model tokens (EOS ignored),
the later turns were continued in their slots (slot memory), the turn breakdown is printed,
and the last line carries the figures under their documented keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_multi_turn_benchmark_runs_on_the_jax_engine():
    done = subprocess.run(
        [sys.executable, "benchmarks/multi_turn.py", "--model", "tiny", "--engines", "jax",
         "--prompts", "2", "--samples", "2", "--turn-tokens", "4", "--observation-tokens", "3",
         "--slots", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert (result["turns"], result["turn_tokens"], result["episodes"]) == (3, 4, 4)
    for key in ("episodes_per_min", "single_per_min", "multi_model_tokens_per_s",
                "single_tokens_per_s", "multi_over_single"):  # fmt: skip
        assert result[f"jax_{key}"] > 0, key
    assert "jax multi: 4 episodes (shapes [(4, 3, 3), (4, 3, 3)]), 48 model tokens" in done.stdout
    assert "jax single: 4 completions, 48 tokens" in done.stdout
    # the timed pass: 2 later turns of 4 episodes, each continued in its slot
    assert "jax: 8 of 8 later turns continued in their slot" in done.stdout
    assert result["jax_slot_hit_rate"] == 1.0
    assert result["jax_decode_steps_multi_over_single"] > 0
    breakdown = json.loads(done.stdout.split("jax turn breakdown (multi-turn pass): ")[1]
                           .splitlines()[0])  # fmt: skip
    assert [breakdown[f"turn{t}_history_tokens"] > 0 for t in (1, 2, 3)] == [True] * 3
    assert breakdown["turn2_history_tokens"] > breakdown["turn1_history_tokens"]
