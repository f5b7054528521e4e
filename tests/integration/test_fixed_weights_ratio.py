"""Issue 11: only sampled tokens reach the loss. At ``optim.learning_rate=0`` the weights never
change, so the importance ratio pi_theta / pi_sampler of every trained token is the engine-trainer
mismatch alone; with each engine in fp32 its token mean must be 1 within 1e-4 on every step.

Before this check the JAX engine swapped the token sampled at the length limit for an EOS with
log-prob 0 that the loss then trained on: ``train/ratio_mean`` was 0.9376 on every smoke step.
The smoke model is tiny and random, so many samples run to ``max_new_tokens`` (asserted).

Issue 14: the same at T=0.6, top_p=0.9, top_k=20: the trainer takes its log-probs under the
engines' truncated, renormalised distribution (`trainer.truncation`), so every token's ratio
(``train/gap/all/ratio_min`` and ``ratio_max``) is 1 within 1e-3 and the lag-0 sampler_kl is
below 1e-6. Without the truncation in the trainer the ratio of a token is off by the mass
top-k / top-p removed from its row. One step per truncated run may hold a nucleus-boundary
flip (a token within fp32 rounding of the top-p cut, in one side's nucleus only): one token
off, the step's mean off by that token's share and no more (see the test). Measured (8
steps): JAX engine, token ratios in [0.999998, 1.000003], lag-0 sampler_kl 7.0e-10; vLLM,
[0.999997, 1.000003], 1.3e-9.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integration.smoke_job import REPO, child_env, smoke_command

RATIO_TOL = 1e-4  # fp32 engine vs fp32 trainer; a forced token at the limit costs ~6e-2
TOKEN_TOL = 1e-3  # every single token's ratio
SAMPLINGS = {
    # name: (steps, overrides); the truncated run is shorter to keep CI time low
    "plain": (20, []),
    "top_p_top_k": (8, ["rollout.temperature=0.6", "rollout.top_p=0.9", "rollout.top_k=20"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("backend", ["jax", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_ratio_is_one_at_fixed_weights(tmp_path, backend, sampling):
    steps, overrides = SAMPLINGS[sampling]
    run_dir = tmp_path / "run"
    command = smoke_command(
        run_dir, f"rollout.backend={backend}", "optim.learning_rate=0", f"trainer.steps={steps}",
        "launch.engine_dtype=float32", "eval.size=0", *overrides,
    )  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # A nucleus-boundary flip (truncated sampling only): a row whose top-p cut falls within
    # fp32 rounding of a token's cumulative probability keeps that token in one side's
    # nucleus and not the other's, and that row's sampled token is off by the token's mass
    # (seen once in CI, vLLM: one token of 256 at ratio 0.9707, the step's mean then off by
    # exactly that token's share, 1.14e-4). At most one such step per run, and in it one token
    # only: the mean is off by no more than that token's share.
    flips = [r for r in rows if r["train/gap/all/ratio_min"] <= 1 - TOKEN_TOL]
    assert len(flips) <= (1 if overrides else 0), [r["train/gap/all/ratio_min"] for r in rows]
    for r in flips:
        share = (1 - r["train/gap/all/ratio_min"]) / r["train/num_tokens"]
        assert r["train/gap/all/ratio_min"] > 0.9, r
        assert abs(r["train/ratio_mean"] - 1) <= share + RATIO_TOL, r
    rows_ok = [r for r in rows if r not in flips]
    ratios = [r["train/ratio_mean"] for r in rows_ok]
    worst = max(abs(x - 1.0) for x in ratios)
    assert worst < RATIO_TOL, ratios
    # the gap as a divergence: KL(sampler || trainer) per token, ~ (log-prob gap)^2 / 2; the k3
    # estimate r - 1 - log r is >= 0 exactly, but in fp32 near r = 1 it rounds to +-1e-9
    assert all(abs(r["train/sampler_kl"]) < 1e-6 for r in rows_ok), [
        r["train/sampler_kl"] for r in rows_ok
    ]
    # every token, not only the mean; and the lag-0 groups (pure engine-trainer mismatch)
    lo = min(r["train/gap/all/ratio_min"] for r in rows_ok)
    hi = max(r["train/gap/all/ratio_max"] for r in rows)
    assert 1 - TOKEN_TOL < lo <= hi < 1 + TOKEN_TOL, (lo, hi)
    lag0 = [r["train/gap/lag0/sampler_kl"] for r in rows_ok if "train/gap/lag0/sampler_kl" in r]
    assert lag0 and all(abs(x) < 1e-6 for x in lag0), lag0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["gap"]["gap/all/tokens"] == sum(r["train/num_tokens"] for r in rows)
    at_limit = sum(r["completions_at_length_limit"] for r in rows)
    kl = max(r["train/sampler_kl"] for r in rows)
    print(
        f"{backend} {sampling}: max |ratio_mean - 1| {worst:.2e}, token ratios in "
        f"[{lo:.6f}, {hi:.6f}], max sampler_kl {kl:.2e} (lag 0: {max(lag0):.2e}), "
        f"{at_limit} at limit, {len(flips)} nucleus-boundary flip steps"
    )
    # samples that ran to the length limit were trained on, their last token included
    assert at_limit > 0
