"""The train step at real model sizes on this host: scanned layers against the Python loop, bf16
mixed precision against fp32, and compile seconds against depth.

Models (random weights built in memory, the shapes of their HF config.json; nothing is
downloaded): `smollm2_360m` (SmolLM2-360M: D 960, F 2,560, 32 layers, 15 heads, 5 KV heads,
V 49,152, tied; 362 M params) and `llama_1b` (Llama-3.2-1B: D 2,048, F 8,192, 16 layers, 32
heads, 8 KV heads, V 128,256, tied, llama3 rope; 1.24 B params).

Each configuration runs in its own subprocess (so its peak RSS is its own): the step
(`trainer.train_step.TrainStep`: forward, fused log-probs, GRPO loss, backward, AdamW with
clipping; one CPU device) is lowered against the abstract state and compiled (`compile_s`: the
abstract model, trace, lower and XLA compile, no param allocated), XLA's plan of its bytes is
read (`planned_gib`: arguments + outputs + temporaries - aliased, i.e. params, Adam moments,
batch and every intermediate), and, when that plan fits `--max-gib`, the state is allocated and
`--steps` steps are timed after one warm-up step (`step_s`, median) with the process's peak RSS
(`rss_gib`, `ru_maxrss`). Micro-batch 1 x `--seq-len` tokens (256). Precision `fp32`: params,
compute and moments fp32; `bf16_mixed`: fp32 master params and Adam moments, bf16 compute
(`model.dtype=bfloat16, model.param_dtype=float32`), the residual stream float32;
`bf16_residual`: as bf16_mixed with a bf16 residual stream and MLP activation
(`model.residual_dtype=bfloat16`).

The depth sweep compiles (only) SmolLM2-360M's layer shape at 4, 16 and 32 layers, fp32, scan
and loop.

With `--paired N`, each model and precision that fit then runs scan and loop in one process
on one state, N alternating steps each: the median of the paired ratios
(`paired_scan_over_loop_step`) is the step comparison to trust on shared cores (the single
runs above are minutes apart, under whatever else the host runs).

Ratios (reference measured in the same run): `scan_over_loop_compile`, `scan_over_loop_step`,
`scan_over_loop_rss`, `mixed_over_fp32_step`, `mixed_over_fp32_rss`,
`bf16_residual_over_bf16_mixed_{planned,step,rss}` per model and layout,
`scan_over_loop_compile_at_{4,16,32}`, and with `--lora R` (a rank-R LoRA step, adapters on
all seven projections, only they trained, in the last layout given) `lora_over_full_planned`,
`lora_over_full_step`, `lora_over_full_rss` per model and precision.

Measured on 2026-12-04 on a 2-core x86 host (avx2, avx512f, avx512_bf16, no AMX) shared with
four other jobs, `--steps 1`, 23 minutes in all: SmolLM2-360M fp32 scan / loop compile 19.1 /
15.0 s, step 12.5 / 5.0 s, RSS 9.1 / 7.5 GiB; bf16_mixed compile 16.8 / 20.2 s, step 6.8 /
17.2 s, RSS 9.4 / 7.0 GiB (the two step ratios, 2.5 and 0.4, disagree: the host's load
swamps single steps; `--paired` is the remedy, not run then). Llama-3.2-1B: XLA plans 23.6 /
23.0 GiB (fp32 scan / loop) and 23.9 / 21.2 GiB (bf16_mixed): not run on the 24 GiB host;
compile 26.7 / 6.4 s (fp32), 38.9 / 11.8 s (mixed). Depth sweep, scan / loop compile: 5.2 /
3.5 s at 4 layers, 14.1 / 6.0 s at 16, 29.5 / 11.9 s at 32. The full-weight Llama-3.2-1B
step itself ran on 2026-12-06 on the same kind of host, quiet (`--models llama_1b
--precisions bf16_mixed --layouts loop --depths '' --max-gib 22.5 --steps 2`): planned
21.2 GiB, compile 7.0 s, step 17.4 s, peak RSS 22.0 GiB of the host's 23.5 GiB (AdamW with
fp32 master weights and moments; fp32 and the scan's stacked copy plan more than fits).

Usage: python benchmarks/model_scale.py [--models smollm2_360m,llama_1b]
    [--precisions fp32,bf16_mixed] [--layouts scan,loop] [--depths 4,16,32] [--seq-len 256]
    [--steps 1] [--max-gib 12] [--remat none] [--paired N] [--no-run] [--lora R]
Prints one line per configuration and ratio, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SMOLLM2_360M = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=960,
    intermediate_size=2560,
    num_hidden_layers=32,
    num_attention_heads=15,
    num_key_value_heads=5,
    head_dim=64,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
)
LLAMA_1B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
)
MODELS = {"smollm2_360m": SMOLLM2_360M, "llama_1b": LLAMA_1B}
#: precision -> (compute dtype, param dtype, residual dtype): `models.config.ModelConfig`.
PRECISIONS = {
    "fp32": ("float32", "float32", "float32"),
    "bf16_mixed": ("bfloat16", "float32", "float32"),
    "bf16_residual": ("bfloat16", "float32", "bfloat16"),
}
GIB = 1 << 30
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _build(spec: dict[str, Any], scan: bool) -> tuple[Any, Any, Any]:
    """(TrainStep over an abstract model, its compiled executable, the host batch) of `spec`
    with `scan` as the layout; nothing is allocated but the batch."""
    import jax
    from flax import nnx
    from train_step import dense_batch

    from models.config import ModelConfig
    from models.decoder import Decoder
    from models.lora import add_lora, is_adapter
    from models.sharding import make_mesh
    from trainer.losses import make_loss
    from trainer.optim import OptimizerConfig, make_optimizer
    from trainer.train_step import TrainStep

    hf = dict(MODELS[spec["model"]])
    if spec["layers"]:
        hf["num_hidden_layers"] = spec["layers"]
    dtype, param_dtype, residual_dtype = PRECISIONS[spec["precision"]]
    cfg = ModelConfig.from_hf(
        hf, dtype=dtype, param_dtype=param_dtype, residual_dtype=residual_dtype
    )
    rank = spec.get("lora", 0)

    def model() -> Decoder:
        m = Decoder(cfg, rngs=nnx.Rngs(0))
        if rank:  # rank-R adapters (alpha 2R) on all seven projections, only they trained
            add_lora(m, rank, 2.0 * rank, LORA_TARGETS, jax.random.key(0))
        return m

    abstract = nnx.eval_shape(model)
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-5, total_steps=100, max_grad_norm=1.0))
    loss, remat = make_loss("grpo"), spec["remat"]
    step = TrainStep(abstract, loss, tx, mesh, temperature=0.7, scan_layers=scan, remat=remat,
                     trainable=is_adapter if rank else None)  # fmt: skip
    batch = dense_batch(1, spec["seq_len"], cfg.vocab_size, group=1)
    return step, step.lower(batch).compile(), batch


def _random_state(step: Any) -> Any:
    """A TrainState of `step` with N(0, 0.02) params (one param at a time) and fresh moments."""
    import jax
    import jax.numpy as jnp

    from trainer.train_step import TrainState

    shapes = step.abstract_state()
    keys = iter(jax.random.split(jax.random.key(0), len(shapes.params)))
    init = {
        k: jax.jit(
            lambda key, s=s: (0.02 * jax.random.normal(key, s.shape, jnp.float32)).astype(s.dtype),
            out_shardings=s.sharding,
        )(next(keys))
        for k, s in shapes.params.items()
    }
    opt = jax.jit(step.tx.init, out_shardings=step.shardings.opt_state)(step.trained(init))
    return TrainState(init, opt, jax.device_put(jnp.int32(0), step.shardings.step))


def _timed(compiled: Any, state: Any, sharded: Any) -> tuple[Any, float, float]:
    """(new state, seconds, loss) of one call of the compiled step."""
    import jax

    t0 = time.perf_counter()
    state, metrics = compiled(state, sharded, None)
    jax.block_until_ready(metrics)
    return state, time.perf_counter() - t0, float(metrics["loss"])


def run_config(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration, in this process: compile, plan, and (if it fits and `run`) steps.

    `spec`: model (a MODELS key), layers (None: the model's), precision (a PRECISIONS key),
    scan (bool), remat (a remat policy name), seq_len (tokens), steps (timed), run (bool),
    max_gib (the planned-bytes bound of running). Returns the figures as a dict (seconds,
    GiB); `skipped` says why no step ran.
    """
    from trainer.batch import shard_batch

    t0 = time.perf_counter()
    step, compiled, batch = _build(spec, spec["scan"])
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    planned = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes
    )
    out: dict[str, Any] = {
        **{k: spec[k] for k in ("model", "precision", "scan", "remat", "seq_len")},
        "lora": spec.get("lora", 0),
        "layers": step.template.cfg.num_layers,
        "params": sum(math.prod(s.shape) for s in step.abstract_state().params.values()),
        "compile_s": round(compile_s, 2),
        "planned_gib": round(planned / GIB, 3),
        "temp_gib": round(mem.temp_size_in_bytes / GIB, 3),
    }
    if not spec["run"]:
        return out
    if planned > spec["max_gib"] * GIB:
        out["skipped"] = f"planned {planned / GIB:.1f} GiB > --max-gib {spec['max_gib']}"
        return out
    state = _random_state(step)
    sharded = shard_batch(batch, step.mesh)
    state, _, _ = _timed(compiled, state, sharded)  # warm-up
    times = []
    for _ in range(spec["steps"]):
        state, seconds, loss = _timed(compiled, state, sharded)
        times.append(seconds)
    out["step_s"] = round(statistics.median(times), 3)
    out["loss"] = loss
    out["rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3)
    return out


def run_paired(spec: dict[str, Any]) -> dict[str, Any]:
    """Scan and loop of one `spec` in this process, on one state, stepped alternately
    `spec["steps"]` times after a warm-up each: the median seconds of each and the median of
    the paired ratios (each scan step over the loop step right after it), which the load of
    shared cores moves less than two runs minutes apart."""
    from trainer.batch import shard_batch

    step, scan_exec, batch = _build(spec, True)
    _, loop_exec, _ = _build(spec, False)
    state = _random_state(step)
    sharded = shard_batch(batch, step.mesh)
    state, _, _ = _timed(scan_exec, state, sharded)
    state, _, _ = _timed(loop_exec, state, sharded)
    scan_s, loop_s = [], []
    for _ in range(spec["steps"]):
        state, a, _ = _timed(scan_exec, state, sharded)
        state, b, _ = _timed(loop_exec, state, sharded)
        scan_s.append(a)
        loop_s.append(b)
    return {
        **{k: spec[k] for k in ("model", "precision", "remat", "seq_len", "steps")},
        "scan_step_s": round(statistics.median(scan_s), 3),
        "loop_step_s": round(statistics.median(loop_s), 3),
        "paired_scan_over_loop_step": round(
            statistics.median(a / b for a, b in zip(scan_s, loop_s, strict=True)), 3
        ),
    }


def in_subprocess(spec: dict[str, Any]) -> dict[str, Any]:
    """`run_config(spec)` in a fresh Python (its own peak RSS); its last stdout line is the
    result. A child that fails is reported with its exit code and last stderr line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {**spec, "error": f"exit {proc.returncode}: {tail}"}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    if key in a and key in b and b[key]:
        return round(a[key] / b[key], 3)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm2_360m,llama_1b")
    parser.add_argument("--precisions", default="fp32,bf16_mixed")
    parser.add_argument("--layouts", default="scan,loop")
    parser.add_argument("--depths", default="4,16,32", help="'' skips the depth sweep")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1, help="timed steps after a warm-up")
    parser.add_argument("--max-gib", type=float, default=12.0, help="run only plans below")
    parser.add_argument("--remat", default="none")
    parser.add_argument("--no-run", action="store_true", help="compile and plan only")
    parser.add_argument(
        "--paired", type=int, default=0, help="then N alternating scan/loop steps per config"
    )
    parser.add_argument(
        "--lora", type=int, default=0, help="then a rank-R LoRA step per model and precision"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(run_paired(spec) if spec.get("paired") else run_config(spec)))
        return
    models = [m for m in args.models.split(",") if m]
    precisions = [p for p in args.precisions.split(",") if p]
    layouts = [x for x in args.layouts.split(",") if x]
    for name, given, known in (
        ("--models", models, MODELS),
        ("--precisions", precisions, PRECISIONS),
        ("--layouts", layouts, ("scan", "loop")),
    ):
        bad = [x for x in given if x not in known]
        if bad:
            parser.error(f"{name}: unknown {bad}; known: {sorted(known)}")
    if args.steps < 1 or args.seq_len < 8 or args.lora < 0:
        parser.error("need --steps >= 1, --seq-len >= 8 and --lora >= 0")
    base = dict(seq_len=args.seq_len, steps=args.steps, remat=args.remat, max_gib=args.max_gib)
    results: dict[str, Any] = {"configs": [], "ratios": {}}
    for model in models:
        got = {}
        for precision in precisions:
            for layout in layouts:
                spec = dict(base, model=model, layers=None, precision=precision)
                spec.update(scan=layout == "scan", run=not args.no_run)
                r = in_subprocess(spec)
                got[precision, layout] = r
                results["configs"].append(r)
                print(f"{model} {precision} {layout}: {json.dumps(r)}", flush=True)
        for p in precisions:
            if ("scan" in layouts) and ("loop" in layouts):
                for key in ("compile", "step", "rss"):
                    field = {"compile": "compile_s", "step": "step_s", "rss": "rss_gib"}[key]
                    v = _ratio(got[p, "scan"], got[p, "loop"], field)
                    results["ratios"][f"{model}_{p}_scan_over_loop_{key}"] = v
        for name, ref in (("bf16_mixed", "fp32"), ("bf16_residual", "bf16_mixed")):
            if name not in precisions or ref not in precisions:
                continue
            short = {"bf16_mixed": "mixed", "bf16_residual": "bf16_residual"}[name]
            for layout in layouts:
                keys = (("planned", "planned_gib"), ("step", "step_s"), ("rss", "rss_gib"))
                for key, field in keys if name == "bf16_residual" else keys[1:]:
                    v = _ratio(got[name, layout], got[ref, layout], field)
                    results["ratios"][f"{model}_{layout}_{short}_over_{ref}_{key}"] = v
        for precision in precisions if args.lora else ():
            layout = layouts[-1]
            spec = dict(base, model=model, layers=None, precision=precision, lora=args.lora)
            spec.update(scan=layout == "scan", run=not args.no_run)
            r = in_subprocess(spec)
            results["configs"].append(r)
            print(f"{model} {precision} {layout} LoRA {args.lora}: {json.dumps(r)}", flush=True)
            for key, field in (("planned", "planned_gib"), ("step", "step_s"), ("rss", "rss_gib")):
                v = _ratio(r, got[precision, layout], field)
                results["ratios"][f"{model}_{precision}_lora_over_full_{key}"] = v
        for precision in precisions if args.paired else ():
            spec = dict(base, model=model, layers=None, precision=precision, paired=True)
            spec.update(steps=args.paired)
            if got.get((precision, "loop"), {}).get("skipped"):
                continue  # does not fit: the single runs said so
            r = in_subprocess(spec)
            results["configs"].append(r)
            print(f"{model} {precision} paired: {json.dumps(r)}", flush=True)
            results["ratios"][f"{model}_{precision}_paired_scan_over_loop_step"] = r.get(
                "paired_scan_over_loop_step"
            )
    depths = [int(d) for d in args.depths.split(",") if d]
    results["depth"] = []
    for depth in depths:
        pair = {}
        for layout in ("scan", "loop"):
            spec = dict(base, model="smollm2_360m", layers=depth, precision="fp32")
            spec.update(scan=layout == "scan", run=False)
            pair[layout] = in_subprocess(spec)
            results["depth"].append(pair[layout])
            print(f"depth {depth} {layout}: compile {pair[layout].get('compile_s')} s", flush=True)
        results["ratios"][f"scan_over_loop_compile_at_{depth}"] = _ratio(
            pair["scan"], pair["loop"], "compile_s"
        )
    for k, v in results["ratios"].items():
        print(f"{k}: {v}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
