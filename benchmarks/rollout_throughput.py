"""Generated tokens per second of the JAX engine and of vLLM on the same model, prompts and
sampling, in the same run (the ratio); and the JAX engine's decode step time against its
roofline: the bytes one step reads (all weights, plus the whole KV cache: at this script's
cache length of 64 + max_tokens the attention bound, `BatcherConfig.kv_bucket`, covers every
slot) over the memory bandwidth measured in the same run, and, since a CPU decode
step of 32 rows is compute-bound, its FLOPs (2 per param per row, plus attention over the whole
cache) over the rate of a decode-shaped matmul measured in the same run; the roofline is the
larger of the two and ``roofline_fraction`` = roofline / measured step.

Usage: python benchmarks/rollout_throughput.py [--model tiny|smollm2|HF_DIR] [--engines jax,vllm]
    [--prompts 16] [--samples 4] [--max-tokens 64] [--slots 32] [--dtype float32]
Both engines ignore EOS, so each sample is exactly --max-tokens long. Prints one line per
measurement, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import model_path
from flax import nnx

from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.engine import EngineConfig, JaxEngine
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request
from trainer.checkpoints.hf_io import load_hf_checkpoint


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[tuple[int, ...]]:
    """``n`` random prompts of 16 to 64 tokens (ids 1 to vocab-1), seeded."""
    rng = np.random.default_rng(seed)
    return [
        tuple(int(t) for t in rng.integers(1, vocab, int(rng.integers(16, 65)))) for _ in range(n)
    ]


def memory_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes per second (read + write) of the faster of a numpy copy and a JAX elementwise pass
    over ``nbytes``, each the median of ``repeats``: the bandwidth a decode step could reach."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    x = jnp.asarray(src)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    best = 0.0
    for run in (lambda: np.copyto(dst, src), lambda: f(x).block_until_ready()):
        run()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        best = max(best, 2 * nbytes / statistics.median(times))
    return best


def run_jax(path: Path, prompts, args) -> dict[str, float]:
    """Tokens/s of the JAX engine (after a warm-up pass) and its decode step time."""
    cfg, model = load_hf_checkpoint(path, dtype=args.dtype)
    params = nnx.split(model)[1]
    max_len = 64 + args.max_tokens
    bcfg = BatcherConfig(num_slots=args.slots, max_len=max_len, prefill_batch=8, steps_per_call=64)
    stops = StopConfig(eos_ids=(cfg.vocab_size,), pad_id=0)  # never sampled: EOS ignored
    ecfg = EngineConfig(bcfg, SamplingConfig(temperature=1.0), stops)
    reqs = [
        Request(i, p, num_samples=args.samples, max_new_tokens=args.max_tokens)
        for i, p in enumerate(prompts)
    ]
    with JaxEngine(cfg, params, ecfg) as engine:
        engine.generate(
            [Request(f"w{r.prompt_id}", r.prompt, r.num_samples, r.max_new_tokens) for r in reqs]
        )  # compiles every bucket
        t = time.perf_counter()
        results = engine.generate(reqs)
        wall = time.perf_counter() - t
    tokens = sum(len(r.tokens) for r in results)
    print(f"jax: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s")

    # decode step time with every slot busy: one long sample per slot, two loops of n steps
    graphdef = nnx.split(model)[0]
    timing = dataclasses.replace(bcfg, steps_per_call=(args.max_tokens - 2) // 2)
    b = ContinuousBatcher(cfg, graphdef, params, timing, ecfg.sampling, stops)
    b.submit(
        [Request(f"s{i}", prompts[i % len(prompts)], 1, args.max_tokens) for i in range(args.slots)]
    )
    b.step()  # fill, compile, 8 steps
    steps0, t = b.decode_steps, time.perf_counter()
    b.step()
    jax.block_until_ready(b.state)
    step_s = (time.perf_counter() - t) / max(b.decode_steps - steps0, 1)
    param_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(params))
    kv_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(b.state.cache))
    print(f"jax decode step {step_s * 1e3:.2f} ms ({b.decode_steps - steps0} steps timed)")
    b_, s_ = args.slots, max_len
    flops = 2 * sum(int(x.size) for x in jax.tree.leaves(params)) * b_
    flops += 4 * b_ * s_ * cfg.num_heads * cfg.head_dim * cfg.num_layers  # q·k and p·v
    return {
        "jax_tokens_per_s": tokens / wall,
        "decode_step_s": step_s,
        "param_bytes": param_bytes,
        "kv_bytes": kv_bytes,
        "step_flops": flops,
        "matmul_flops_per_s": matmul_rate(args.slots, cfg.hidden_size, cfg.vocab_size),
    }


def matmul_rate(b: int, d: int, v: int, repeats: int = 5) -> float:
    """FLOP/s of a decode-shaped fp32 matmul ``[b, d] x [d, v]`` in JAX (median)."""
    x = jnp.ones((b, d), jnp.float32)
    w = jnp.ones((d, v), jnp.float32)
    f = jax.jit(jnp.dot)
    f(x, w).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(x, w).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * b * d * v / statistics.median(times)


def run_vllm(path: Path, prompts, args) -> float:
    """Tokens/s of the vLLM backend (after a warm-up request)."""
    from gateway import messages as m
    from rollout_engine.vllm.backend import VllmBackend, VllmBackendConfig

    async def go() -> float:
        backend = VllmBackend(
            VllmBackendConfig(model=str(path), dtype=args.dtype, max_model_len=64 + args.max_tokens)
        )
        await backend.start()
        try:
            sampling = m.SamplingParams(
                max_new_tokens=args.max_tokens, temperature=1.0, ignore_eos=True
            )

            def prompt(sid: str, tokens) -> m.Prompt:
                return m.Prompt(sid, np.asarray(tokens, np.int32), args.samples, sampling)

            await asyncio.gather(
                *(backend.generate(prompt(f"w{i}", p)) for i, p in enumerate(prompts))
            )
            t = time.perf_counter()
            groups = await asyncio.gather(
                *(backend.generate(prompt(f"p{i}", p)) for i, p in enumerate(prompts))
            )
            wall = time.perf_counter() - t
        finally:
            await backend.shutdown()
        tokens = sum(len(s.token_ids) for g in groups for s in g)
        print(f"vllm: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s")
        return tokens / wall

    return asyncio.run(go())


def main() -> None:
    """Runs the engines asked for and prints the figures and ratios as JSON on the last line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--engines", default="jax,vllm")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    if args.max_tokens < 24:
        parser.error("--max-tokens must be >= 24 (the step timing runs 16 decode steps)")
    engines = set(args.engines.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        prompts = make_prompts(args.prompts, vocab)
        out: dict[str, object] = {"model": args.model, "dtype": args.dtype}
        if "jax" in engines:
            figures = run_jax(path, prompts, args)
            bandwidth = memory_bandwidth()
            memory_s = (figures["param_bytes"] + figures["kv_bytes"]) / bandwidth
            compute_s = figures["step_flops"] / figures["matmul_flops_per_s"]
            roofline = max(memory_s, compute_s)
            print(
                f"bandwidth {bandwidth / 1e9:.1f} GB/s -> {memory_s * 1e3:.2f} ms; matmul "
                f"{figures['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s -> {compute_s * 1e3:.2f} ms"
            )
            out.update(figures)
            out["bandwidth_GBps"] = bandwidth / 1e9
            out["memory_roofline_step_s"] = memory_s
            out["compute_roofline_step_s"] = compute_s
            out["roofline_step_s"] = roofline
            out["roofline_fraction"] = roofline / figures["decode_step_s"]
        if "vllm" in engines:
            out["vllm_tokens_per_s"] = run_vllm(path, prompts, args)
        if "jax_tokens_per_s" in out and "vllm_tokens_per_s" in out:
            jax_tps, vllm_tps = out["jax_tokens_per_s"], out["vllm_tokens_per_s"]
            out["jax_over_vllm"] = float(jax_tps) / float(vllm_tps)  # type: ignore[arg-type]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
