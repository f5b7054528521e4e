"""Tokens per second of the RL train step and its model FLOP/s against two matmul rates
measured in the same run: JAX's own matmul in the compute dtype, and the machine's best
matmul (the fastest of torch bf16, torch fp32 and that JAX matmul: torch bf16 runs through
oneDNN, on AMX where the CPU has it).

The step is `trainer.train_step.TrainStep` (forward, fused log-probs at temperature 0.7, GRPO
loss, backward, AdamW with gradient clipping) on a one-device mesh, fed an `RLBatch` from
`build_rl_batch` of B rows that each fill the padded length T exactly (prompt T/4 tokens,
completion 3T/4 random tokens), so no position is padding. After one compiling call, `--steps`
calls are timed (each includes sharding the host batch and fetching the metrics); the figure is
the median.

FLOPs are model FLOPs, as in PaLM (Chowdhery et al. 2022, appendix B), per trained position:
6·N + 12·layers·heads·head_dim·T, where N counts the matmul params (every `.kernel`, plus the
tied LM head once; the embedding lookup is not a matmul) and the second term is attention's
q·k and p·v over the full T×T square (what the masked kernel computes), forward and backward.
Positions are B·T. The step's FLOP/s is that over the median step time. `over_jax_matmul`
divides it by the FLOP/s of a square `--matmul-size` matmul in the compute dtype
(jit(jnp.dot)), measured right after each timed step (median of 3 matmuls): the median over
the steps of step FLOP/s / that matmul FLOP/s (paired, as the load of shared cores changes
during a run). It says how close the step comes to what JAX's own matmul reaches, not to the
machine: `over_best_matmul` divides the step's FLOP/s by the best matmul rate
(`best_matmul_flops_per_s`, the fastest of torch bf16, torch fp32 and JAX, each a median of 3
square matmuls measured once after the steps). Measured on 2026-12-01 on a 2-core AMD EPYC
host with AVX2 but neither AVX-512 BF16 nor AMX, at size 1024: torch bf16 0.5 GFLOP/s (no
native bf16 path), torch fp32 24.8, JAX fp32 22.5, so the best there is torch fp32 and the
small model's fp32 step reached 0.68 of JAX's matmul and 0.62 of the best. On an
accelerator the peak of its datasheet would be the reference instead.

Models: `small` (random llama: V 8,192, D 512, F 1,536, 6 layers, 8 heads, 4 KV heads; 27 M
params, defaults B 8, T 256) and `smollm2` (the real SmolLM2-135M-Instruct; defaults B 8,
T 128).

Usage: python benchmarks/train_step.py [--model small|smollm2] [--batch B] [--seq-len T]
    [--steps 5] [--micro-batches 1] [--dtype float32|bfloat16] [--matmul-size 2048]
Prints one line per measurement, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gateway.messages import Completion
from models.config import ModelConfig
from models.decoder import Decoder
from models.params import flat_params
from models.sharding import make_mesh
from trainer.batch import RLBatch, build_rl_batch
from trainer.losses import make_loss
from trainer.optim import OptimizerConfig, make_optimizer
from trainer.rollouts import RolloutGroup
from trainer.train_step import TrainStep

SMALL = dict(
    model_type="llama",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
)
DEFAULT_SHAPES = {"small": (8, 256), "smollm2": (8, 128)}
TEMPERATURE = 0.7


def build_model(name: str, dtype: str) -> Decoder:
    """`small`: a random Decoder of SMALL's shape; `smollm2`: the real checkpoint."""
    if name == "small":
        return Decoder(ModelConfig.from_hf(SMALL, dtype=dtype), rngs=nnx.Rngs(0))
    from models.checkpoints.hf_io import load_hf_checkpoint
    from models.checkpoints.smollm2 import ensure_smollm2

    return load_hf_checkpoint(ensure_smollm2(), dtype=dtype)[1]


def dense_batch(rows: int, length: int, vocab: int, group: int = 4, seed: int = 0) -> RLBatch:
    """B = `rows` rows of exactly `length` tokens (prompt length/4, completion the rest),
    random ids in [1, vocab), sampler log-probs near -log(vocab), rewards alternating 0/1 inside
    each group of `group` (so every advantage is nonzero); `seed` picks the tokens.

    Raises:
        ValueError: rows not a multiple of `group`, or length < 8.
    """
    if rows % group or length < 8:
        raise ValueError(f"need rows % {group} == 0 and length >= 8; got {rows}, {length}")
    rng = np.random.default_rng(seed)
    prompt_len = length // 4
    groups = []
    for g in range(rows // group):
        prompt = rng.integers(1, vocab, prompt_len).tolist()
        comps = []
        for i in range(group):
            ids = rng.integers(1, vocab, length - prompt_len).tolist()
            lps = (-np.log(vocab) + 0.1 * rng.standard_normal(len(ids))).tolist()
            comps.append(Completion(ids, lps, "length", 0, 0, reward=float(i % 2)))
        groups.append(RolloutGroup(f"g{g}", prompt, comps))
    return build_rl_batch(groups, buckets=[length])


def model_flops_per_position(model: Decoder, length: int) -> tuple[float, int]:
    """(training FLOPs per position, matmul params N): 6·N + 12·layers·heads·head_dim·T
    (PaLM, appendix B); N = every `.kernel` plus the tied LM head (V·D) once."""
    cfg = model.cfg
    params = flat_params(model)
    n = sum(int(np.prod(v.shape)) for k, v in params.items() if k.endswith(".kernel"))
    if cfg.tie_word_embeddings:
        n += cfg.vocab_size * cfg.hidden_size
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length
    return 6.0 * n + attention, n


class MatmulProbe:
    """The reference: a compiled square [size, size] x [size, size] matmul in `dtype`."""

    def __init__(self, size: int, dtype: str) -> None:
        key = jax.random.key(0)
        self.size = size
        self.x = jax.random.normal(key, (size, size), dtype)
        self.w = jax.random.normal(jax.random.fold_in(key, 1), (size, size), dtype)
        self.f = jax.jit(jnp.dot)
        self.f(self.x, self.w).block_until_ready()

    def flops_per_s(self, repeats: int = 3) -> float:
        """Median FLOP/s (2·size³ per matmul) of `repeats` runs."""
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.f(self.x, self.w).block_until_ready()
            times.append(time.perf_counter() - t0)
        return 2.0 * self.size**3 / statistics.median(times)


def torch_matmul_rate(size: int, dtype: str, repeats: int = 3) -> float:
    """Median FLOP/s (2·size³ per matmul) of a square torch matmul in `dtype` on the CPU
    (oneDNN; bf16 uses AMX where the CPU has it), after one warm-up."""
    import torch

    x = torch.randn(size, size, dtype=getattr(torch, dtype))
    w = torch.randn(size, size, dtype=getattr(torch, dtype))
    torch.matmul(x, w)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(x, w)
        times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="small", choices=("small", "smollm2"))
    parser.add_argument("--batch", type=int, help="rows B (default per model)")
    parser.add_argument("--seq-len", type=int, help="padded length T (default per model)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the first")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="compute and param dtype",
    )
    parser.add_argument("--matmul-size", type=int, default=2048)
    args = parser.parse_args()
    rows, length = DEFAULT_SHAPES[args.model]
    rows, length = args.batch or rows, args.seq_len or length
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")

    model = build_model(args.model, args.dtype)
    flops_per_pos, n_matmul = model_flops_per_position(model, length)
    num_params = sum(int(np.prod(v.shape)) for v in flat_params(model).values())
    batch = dense_batch(rows, length, model.cfg.vocab_size)
    positions = rows * length
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-5, total_steps=100, max_grad_norm=1.0))
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    step = TrainStep(
        model,
        make_loss("grpo"),
        tx,
        mesh,
        temperature=TEMPERATURE,
        micro_batches=args.micro_batches,
    )
    state = step.init_state(model)
    probe = MatmulProbe(args.matmul_size, args.dtype)
    step_flops = flops_per_pos * positions
    print(
        f"{args.model}: {num_params / 1e6:.1f} M params ({n_matmul / 1e6:.1f} M in matmuls), "
        f"B={rows} T={length}, {flops_per_pos * positions / 1e9:.1f} GFLOP per step"
    )

    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    compile_s = time.perf_counter() - t0
    print(f"first step (compile + run): {compile_s:.1f} s; loss {metrics['loss']:.4f}")
    times, refs = [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        times.append(time.perf_counter() - t0)
        refs.append(probe.flops_per_s())
        print(
            f"step {i + 1}: {times[-1]:.3f} s, {positions / times[-1]:.0f} tokens/s, "
            f"{step_flops / times[-1] / 1e9:.1f} GFLOP/s (matmul right after: "
            f"{refs[-1] / 1e9:.1f} GFLOP/s), loss {metrics['loss']:.4f}"
        )
    step_s = statistics.median(times)
    reference = statistics.median(refs)
    over_jax = statistics.median(step_flops / t / r for t, r in zip(times, refs, strict=True))
    rates = {f"torch_{d}": torch_matmul_rate(args.matmul_size, d) for d in ("bfloat16", "float32")}
    rates[f"jax_{args.dtype}"] = probe.flops_per_s()
    best_name, best = max(rates.items(), key=lambda kv: kv[1])
    print(
        "matmul GFLOP/s: "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rates.items())
        + f"; best {best_name}"
    )
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "params": num_params,
        "matmul_params": n_matmul,
        "batch": rows,
        "seq_len": length,
        "micro_batches": args.micro_batches,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(positions / step_s, 1),
        "loss_tokens_per_s": round(float(metrics["num_tokens"]) / step_s, 1),
        "compile_s": round(compile_s, 1),
        "model_flops_per_step": step_flops,
        "flops_per_s": round(step_flops / step_s, 0),
        "matmul_flops_per_s": round(reference, 0),
        "over_jax_matmul": round(over_jax, 4),
        "best_matmul": best_name,
        "best_matmul_flops_per_s": round(best, 0),
        "over_best_matmul": round(step_flops / step_s / best, 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
