"""Seconds until a (re)started JAX engine has served its first prompts, without and with JAX's
persistent compilation cache (`launch.xla_cache`, `trainer.launch.commands.xla_cache_env`),
in one run: what a run waits for when the supervisor restarts a dead JAX engine.

Each start is a fresh process (`--child`), so nothing compiled survives in memory: the JAX
backend on the model (`--model`, default the real SmolLM2-135M-Instruct, fp32) with `--slots`
slots starts, then serves `--prompts` prompts of 24 to 88 random token ids at once (greedy,
`--max-new-tokens`, every prefill bucket and the decode program compile here), and exits.
Three starts: `no_cache` (the reference: JAX_COMPILATION_CACHE_DIR unset), `cold` (an empty
cache folder: compiles and writes) and `warm` (the same folder again: a restart).
`warm_over_no_cache` is warm seconds over no-cache seconds; the completions of the three
starts must be the same token for token (`same_tokens`).

Usage: python benchmarks/engine_restart.py [--model smollm2|tiny|HF_DIR] [--slots 8]
    [--prompts 8] [--max-new-tokens 32]
Prints one line per start, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import model_path


def child(args: argparse.Namespace) -> None:
    """One start: prints {"start_s", "serve_s", "tokens"} as JSON."""
    from gateway import messages as m
    from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig

    rng = np.random.default_rng(0)
    lengths = rng.integers(24, 89, args.prompts)
    sampling = m.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    prompts = [
        m.Prompt(f"p{i}", rng.integers(5, 1000, n).astype(np.int32), 1, sampling)
        for i, n in enumerate(lengths)
    ]
    cfg = JaxBackendConfig(model=args.child, num_slots=args.slots, max_model_len=256,
                           temperature=0.0)  # fmt: skip

    async def go() -> tuple[float, float, list[list[int]]]:
        backend = JaxBackend(cfg)
        t0 = time.perf_counter()
        await backend.start()
        start_s = time.perf_counter() - t0
        try:
            groups = await asyncio.gather(*(backend.generate(p) for p in prompts))
        finally:
            await backend.shutdown()
        return (
            start_s,
            time.perf_counter() - t0 - start_s,
            [g[0].token_ids.tolist() for g in groups],
        )

    start_s, serve_s, tokens = asyncio.run(go())
    print(json.dumps({"start_s": start_s, "serve_s": serve_s, "tokens": tokens}))


def main() -> None:
    """Runs the three starts and prints the figures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        cache = Path(tmp) / "xla"
        base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
        base |= {"JAX_PLATFORMS": "cpu"}
        results = {}
        for name in ("no_cache", "cold", "warm"):
            env = base if name == "no_cache" else base | {"JAX_COMPILATION_CACHE_DIR": str(cache)}
            argv = [
                sys.executable, __file__, "--child", str(path), "--slots", str(args.slots),
                "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
            ]  # fmt: skip
            t0 = time.perf_counter()
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
            wall = time.perf_counter() - t0
            if done.returncode != 0:
                raise SystemExit(f"{name} start failed:\n{done.stderr[-3000:]}")
            out = json.loads(done.stdout.strip().splitlines()[-1])
            results[name] = out | {"process_s": wall}
            print(
                f"{name}: process {wall:.1f} s (backend start {out['start_s']:.1f} s, "
                f"{args.prompts} prompts served {out['serve_s']:.1f} s)",
                flush=True,
            )
        files = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    ready = {k: v["start_s"] + v["serve_s"] for k, v in results.items()}
    result = {
        "benchmark": "engine_restart",
        "model": args.model,
        "slots": args.slots,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        **{f"{k}_ready_s": round(v, 2) for k, v in ready.items()},
        **{f"{k}_process_s": round(v["process_s"], 2) for k, v in results.items()},
        "cache_bytes": files,
        "warm_over_no_cache": ready["warm"] / ready["no_cache"],
        "cold_over_no_cache": ready["cold"] / ready["no_cache"],
        "same_tokens": len({json.dumps(v["tokens"]) for v in results.values()}) == 1,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
