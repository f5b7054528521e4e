"""The train step with LoRA against full fine-tuning, each in its own subprocess (so its peak
RSS is its own): seconds per step, peak RSS (`ru_maxrss`), bytes of the optimizer state and
of the trained params, and the bytes a push carries.

The step is `trainer.train_step.TrainStep` (forward, log-probs, GRPO loss, backward, clipped
AdamW) on a one-device mesh over the dense batch of `benchmarks/train_step.py` (B rows of T
tokens); with `--lora R` the adapters of rank R (alpha 2R) sit on all seven projections and
only they are trained (`TrainStep(trainable=is_adapter)`: only their gradients are computed).
After one compiling call `--steps` calls are timed; the figure is the median.

Push bytes: by default a LoRA push carries the merged model (`models.lora.engine_params`), the
same bytes as a full push (`push_bytes`); `adapter_bytes` is what an adapter-only push
(`sync.lora_only`) carries (A and B in the param dtype), computed here from the shapes; the
pushes themselves are measured by `python benchmarks/weight_sync.py --lora RANK`.

Measured 2026-12-04 on a 2-core AMD EPYC (avx2, avx512f, avx512_bf16), shared, `small` model
(27 M params, fp32, B 8 x T 256), rank 16 on all seven projections, gradients of the adapters
only: optimizer state 7.5 MB against 218 MB (0.034), peak RSS 1.77 against 2.07 GiB (0.86;
0.96 while the base gradients were still computed: activations dominate at this size),
seconds per step 3.79 against 3.73 (1.02: the unmerged adapters' dots cost what the base
weight gradients saved), push bytes equal (merged weights), an adapter-only push would carry
3.7 MB of 109 MB (0.034).

Usage: python benchmarks/lora_train.py [--model small|smollm2] [--lora 16] [--steps 3]
Prints one line per run, then one JSON object on the last line (ratios LoRA / full).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax

GIB = 1 << 30
DEFAULT_SHAPES = {"small": (8, 256), "smollm2": (8, 128)}


def _nbytes(tree: Any) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def run(model_name: str, rank: int, steps: int) -> dict[str, Any]:
    """One configuration in this process: the figures of the module docstring."""
    from train_step import build_model, dense_batch

    from models.lora import add_lora, engine_params, is_adapter
    from models.sharding import make_mesh
    from trainer.losses import make_loss
    from trainer.optim import OptimizerConfig, make_optimizer
    from trainer.train_step import TrainStep

    model = build_model(model_name, "float32")
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-5, total_steps=100))
    if rank:
        add_lora(model, rank, 2.0 * rank, ("q_proj", "k_proj", "v_proj", "o_proj",
                 "gate_proj", "up_proj", "down_proj"), jax.random.key(0))  # fmt: skip
    rows, length = DEFAULT_SHAPES[model_name]
    batch = dense_batch(rows, length, model.cfg.vocab_size)
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    trainable = is_adapter if rank else None
    step = TrainStep(model, make_loss("grpo"), tx, mesh, trainable=trainable)
    state = step.init_state(model)
    state, _ = step(state, batch)  # compiles
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        float(metrics["loss"])
        times.append(time.perf_counter() - t0)
    trained = {k: v for k, v in state.params.items() if is_adapter(k) or not rank}
    return {
        "rank": rank,
        "s_per_step": round(statistics.median(times), 4),
        "rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3),
        "opt_state_bytes": _nbytes(state.opt_state),
        "trained_param_bytes": _nbytes(trained),
        "push_bytes": _nbytes(engine_params(step.model(state))),
        "adapter_bytes": _nbytes({k: v for k, v in state.params.items() if is_adapter(k)}),
    }


def in_subprocess(model_name: str, rank: int, steps: int) -> dict[str, Any]:
    """`run` in a fresh Python (its own peak RSS); the child's last stdout line is its JSON."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", model_name, str(rank),
           str(steps)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"child {model_name} rank {rank} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    """Runs the full fine-tune and the LoRA step; prints them and the ratios."""
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="small", choices=tuple(DEFAULT_SHAPES))
    parser.add_argument("--lora", type=int, default=16, help="adapter rank R (>= 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    args = parser.parse_args()
    if args.lora < 1 or args.steps < 1:
        parser.error("--lora and --steps must be >= 1")
    full = in_subprocess(args.model, 0, args.steps)
    print(f"{args.model} full fine-tune: {json.dumps(full)}", flush=True)
    lora = in_subprocess(args.model, args.lora, args.steps)
    print(f"{args.model} LoRA rank {args.lora}: {json.dumps(lora)}", flush=True)
    ratios = {
        k: round(lora[k] / full[k], 4)
        for k in ("s_per_step", "rss_gib", "opt_state_bytes", "push_bytes")
    }
    ratios["adapter_over_full_push_bytes"] = round(lora["adapter_bytes"] / full["push_bytes"], 5)
    print(json.dumps({"model": args.model, "rank": args.lora, "full": full, "lora": lora,
                      "lora_over_full": ratios}))  # fmt: skip


if __name__ == "__main__":
    main()
