"""The engine-trainer gap at unchanged weights, for each engine and dtype, in one run.

Runs the real job (``python -m trainer train``: gateway, one engine process, the fp32 trainer)
for N steps at ``optim.learning_rate=0`` once per case (JAX engine fp32, vLLM fp32, vLLM bf16),
so the importance ratio pi_trainer / pi_engine of every token is the numerical mismatch alone
(with max_lag >= 1 some groups are one version stale, at the same weights). Prints one table
row per case with the gap figures of `trainer.gap` over the run's tokens (the run's
``summary.json`` ``gap``): the k3 sampler_kl, the ratio's mean, min, max and 1st / 99th
percentiles (of the step values: min of mins, max of maxes, token-weighted means otherwise),
and the share of tokens with |log ratio| > 0.2; the last line is one JSON object with every
figure and the bf16 / fp32 sampler_kl ratio (the reference measured in the same run).

Usage: python benchmarks/mismatch.py [--model smollm2|tiny|HF_DIR] [--steps 3]
    [--cases jax:float32,vllm:float32,vllm:bfloat16] [--temperature 1.0] [--top-p 1.0]
    [--top-k 0]

Measured 2026-12-01 (2-core CPU, SmolLM2-135M-Instruct, 3 steps, T=1, all tokens / lag 0):
JAX fp32 sampler_kl 3.4e-9 / 3.9e-9, ratio in [0.99996, 1.00004]; vLLM fp32 2.9e-9 / 3.3e-9,
[0.99994, 1.00002]; vLLM bf16 1.1e-3 / 7.9e-4, [0.704, 1.223], p01 0.882, p99 1.127, 0.58% of
tokens with |log r| > 0.2; bf16 / fp32 sampler_kl 4.0e5.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainer.gap import GAP_STATS as FIGURES

REPO = Path(__file__).resolve().parents[1]


def model_arg(name: str) -> str:
    """The job's ``model.path`` for `name`: "smollm2" (the real SmolLM2-135M-Instruct folder),
    "tiny" (the smoke run's random tiny model) or an HF folder."""
    if name == "smollm2":
        from models.checkpoints.smollm2 import ensure_smollm2

        return str(ensure_smollm2())
    if name == "tiny":
        return "tiny:smollm2"
    return name


def run_case(
    backend: str, dtype: str, model: str, steps: int, sampling: list[str], tmp: Path
) -> dict:
    """One job at learning rate 0; returns its summary's gap figures and wall seconds.

    Raises:
      RuntimeError: the job failed (its stderr's tail in the message).
    """
    run_dir = tmp / f"{backend}-{dtype}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"JAXRL_CACHE_DIR": str(tmp / "cache"), "JAX_PLATFORMS": "cpu"}
    command = [
        sys.executable, "-m", "trainer", "train", "--config", "configs/smoke.yaml",
        f"run_dir={run_dir}", "launch.progress=false", f"rollout.backend={backend}",
        f"model.path={model}", "optim.learning_rate=0", f"trainer.steps={steps}",
        f"launch.engine_dtype={dtype}", "eval.size=0", *sampling,
    ]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{backend} {dtype} failed:\n{done.stderr[-3000:]}")
    gap = json.loads((run_dir / "summary.json").read_text())["gap"]
    return {"wall_s": round(wall, 1), **gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", default="jax:float32,vllm:float32,vllm:bfloat16")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    args = parser.parse_args()
    sampling = [
        f"rollout.temperature={args.temperature}",
        f"rollout.top_p={args.top_p}",
        f"rollout.top_k={args.top_k}",
    ]
    model = model_arg(args.model)
    results: dict[str, dict] = {}
    header = f"{'case':<14} {'set':<9}" + "".join(f" {f:>12}" for f in FIGURES)
    print(
        f"model {model}, {args.steps} steps at learning rate 0, trainer float32; "
        + " ".join(sampling)
    )
    print(header, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            backend, dtype = case.split(":")
            try:
                out = run_case(backend, dtype, model, args.steps, sampling, Path(tmp))
            except RuntimeError as err:  # report it and go on with the other cases
                print(f"{case:<14} FAILED: {err}", flush=True)
                results[case] = {"error": str(err)[-500:]}
                continue
            results[case] = out
            for name in ("all", "lag0", "lag1plus"):
                if f"gap/{name}/tokens" not in out:
                    continue
                row = "".join(f" {out[f'gap/{name}/{f}']:>12.7g}" for f in FIGURES)
                print(f"{case:<14} {name:<9}{row}", flush=True)
    final: dict = {"model": args.model, "steps": args.steps, "cases": results}
    fp32, bf16 = results.get("vllm:float32"), results.get("vllm:bfloat16")
    if fp32 and bf16 and fp32.get("gap/all/sampler_kl", 0) > 0 and "error" not in bf16:
        final["vllm_bf16_over_fp32_sampler_kl"] = (
            bf16["gap/all/sampler_kl"] / fp32["gap/all/sampler_kl"]
        )
    print(json.dumps(final), flush=True)


if __name__ == "__main__":
    main()
