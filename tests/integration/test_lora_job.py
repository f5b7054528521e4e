"""The main job with LoRA (smoke config, `lora.rank=8` on every projection, engines in fp32)
at ``optim.learning_rate=0`` after a random non-zero B (``lora.init_b_std``): the adapters never
change, and each push carries the base with the adapters merged (`models.lora.engine_params`),
or, with ``sync.lora_only``, the adapters alone, which the JAX engine merges into its start
checkpoint and vLLM serves as a LoRA id per version (issue 30).

Step 1 trains on rollouts of version 0, which the engine made with the base checkpoint it
started from, so its token ratios are off (the adapter matters); at ``max_lag=0`` every later
step trains only on rollouts of the pushed versions, whose weights are the trainer's, so every
token's ratio is 1 within 1e-4."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integration.smoke_job import REPO, child_env, jsonl_rows, smoke_command

TOL = 1e-4
STEPS = 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "lora_only"),
    [("jax", False), ("jax", True), pytest.param("vllm", True, marks=pytest.mark.vllm)],
)
def test_lora_job_at_fixed_weights_has_unit_ratios_after_the_first_push(
    tmp_path, backend, lora_only
):
    run_dir = tmp_path / "run"
    command = smoke_command(
        run_dir, f"rollout.backend={backend}", "optim.learning_rate=0", f"trainer.steps={STEPS}",
        "launch.engine_dtype=float32", "eval.size=0", "rollout.max_lag=0", "lora.rank=8",
        "lora.alpha=16", "lora.init_b_std=0.05", f"sync.lora_only={str(lora_only).lower()}",
    )  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = jsonl_rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["version"], summary["stop_reason"]) == (
        STEPS,
        STEPS,
        "completed",
    )
    lo = [r["train/gap/all/ratio_min"] for r in rows]
    hi = [r["train/gap/all/ratio_max"] for r in rows]
    print(f"token ratio ranges per step: {list(zip(lo, hi, strict=True))}; summary {summary}")
    # version 0 is the engine's base checkpoint, not the adapted model
    assert max(abs(lo[0] - 1), abs(hi[0] - 1)) > 1e-2
    for step, (a, b) in enumerate(zip(lo[1:], hi[1:], strict=True), start=2):
        assert 1 - TOL < a <= b < 1 + TOL, (step, a, b)
