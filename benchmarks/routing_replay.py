"""Routing replay against the trainer's own routers, at unchanged weights, in one run.

Runs the real job (``python -m trainer train``: gateway, one JAX engine process, the fp32
trainer) on a tiny mixture-of-experts model at ``optim.learning_rate=0`` twice on the same
seeds, so both runs train on the same rollouts: once with the trainer's own routers
(``rollout.return_routes=true``: the engines' routes only feed the agreement metric), once with
``loss.routing_replay=engine``. A bf16 engine against the fp32 trainer (the default) breaks
router near-ties differently from the trainer, which is the case replay is for; an fp32
engine agrees everywhere on a random tiny model. Prints, per case, the run's gap figures
(`trainer.gap`, the run's ``summary.json``) and the routing agreement per step; the last line
is one JSON object with every figure and the replay / own-routers sampler_kl ratio (the
reference measured in the same run).

Usage: python benchmarks/routing_replay.py [--model tiny:qwen3_moe|HF_DIR] [--steps 3]
    [--engine-dtype bfloat16]

Measured 2026-12-04 (2-core CPU with AVX-512 and avx512_bf16, tiny:qwen3_moe, 3 steps, T=1,
bf16 JAX engine): own routers: agreement 0.965-0.991 per step, token ratios in [0.734, 1.732],
run sampler_kl 5.5e-4, 0.57% of tokens with |log r| > 0.2; replay: token ratios in [0.978,
1.021], sampler_kl 2.4e-5, no token past 0.2; replay / own sampler_kl 0.043.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from mismatch import run_case

CASES = {"own_routers": ["rollout.return_routes=true"], "replay": ["loss.routing_replay=engine"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen3_moe")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engine-dtype", default="bfloat16")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    print(f"model {args.model}, {args.steps} steps at learning rate 0, JAX engine "
          f"{args.engine_dtype}, trainer float32, T=1", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in CASES.items():
            where = Path(tmp) / name
            where.mkdir()
            out = run_case("jax", args.engine_dtype, args.model, args.steps, overrides, where)
            metrics = where / f"jax-{args.engine_dtype}" / "metrics.jsonl"
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            out["routing_agreement"] = [r["train/routing_agreement"] for r in rows]
            results[name] = out
            print(
                f"{name:<12} ratio in [{out['gap/all/ratio_min']:.5f}, "
                f"{out['gap/all/ratio_max']:.5f}], sampler_kl {out['gap/all/sampler_kl']:.3g}, "
                f"|log r| > 0.2: {out['gap/all/frac_log_ratio_gt_0.2']:.4f}, agreement per "
                f"step {[round(a, 4) for a in out['routing_agreement']]}",
                flush=True,
            )
    own, replay = results["own_routers"], results["replay"]
    final = {
        "model": args.model,
        "steps": args.steps,
        "engine_dtype": args.engine_dtype,
        "cases": results,
        "replay_over_own_sampler_kl": replay["gap/all/sampler_kl"] / own["gap/all/sampler_kl"],
    }
    print(json.dumps(final), flush=True)


if __name__ == "__main__":
    main()
