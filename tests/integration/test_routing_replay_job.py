"""Issue 29, routing replay through the main job: a tiny Qwen3-MoE at unchanged weights
(``optim.learning_rate=0``), fp32 engine and trainer, T = 1, on the JAX engine and on vLLM
(whose worker records the routes, `rollout_engine.vllm.routes`). With
``loss.routing_replay=engine`` every token's importance ratio is 1 within 1e-4 on every step
and the routing agreement is reported; with replay off and ``rollout.return_routes`` the
agreement is reported all the same. Asking for replay on a dense model fails before anything
starts, naming the model.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.integration.smoke_job import REPO, child_env, jsonl_rows, smoke_command

TOKEN_TOL = 1e-4
MOE = ["model.path=tiny:qwen3_moe", "launch.engine_dtype=float32"]
FIXED = ["optim.learning_rate=0", "trainer.steps=3", "eval.size=0", "rollout.temperature=1.0"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "replay"),
    [("jax", "engine"), ("jax", "off"), pytest.param("vllm", "engine", marks=pytest.mark.vllm)],
)
def test_ratio_is_one_with_replay_at_fixed_weights(tmp_path, backend, replay):
    run_dir = tmp_path / "run"
    asked = ["loss.routing_replay=engine"] if replay == "engine" else ["rollout.return_routes=true"]
    command = smoke_command(run_dir, *MOE, f"rollout.backend={backend}", *FIXED, *asked)
    done = subprocess.run(
        command, cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = jsonl_rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    lo = min(r["train/gap/all/ratio_min"] for r in rows)
    hi = max(r["train/gap/all/ratio_max"] for r in rows)
    agreement = [r["train/routing_agreement"] for r in rows]
    pairs = [r["train/routing/pairs"] for r in rows]
    # every loss token x layer pair has a route: 2 layers per trained token
    assert pairs == [2 * r["train/num_tokens"] for r in rows]
    assert all(0.0 <= a <= 1.0 for a in agreement)
    if replay == "engine":
        assert 1 - TOKEN_TOL < lo <= hi < 1 + TOKEN_TOL, (lo, hi)
    print(
        f"{backend}, replay {replay}: token ratios in [{lo:.7f}, {hi:.7f}], agreement {agreement}"
    )


@pytest.mark.slow
def test_replay_on_a_dense_model_is_refused_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    command = smoke_command(
        run_dir, "model.path=tiny:qwen3", "rollout.backend=jax", "loss.routing_replay=engine"
    )
    done = subprocess.run(
        command, cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "need a mixture-of-experts model" in done.stderr
    assert "is the dense qwen3; nothing was started" in done.stderr
    assert not (run_dir / "metrics.jsonl").exists()
