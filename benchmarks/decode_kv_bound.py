"""The decode attention bound (`BatcherConfig.kv_bucket`) against attending to every slot.

A decode step attends over cache slots [0, kv_len) where kv_len is the smallest power-of-two
multiple of `kv_bucket` (128) that holds every running slot's position plus `steps_per_call`,
instead of all S = max_len slots. This script times the JAX engine's decode step (the same
`ContinuousBatcher` set-up as `rollout_throughput.py`: every slot busy, one long sample per
slot, the mean step time of one compiled loop) at the same used positions (prompts of 16 to
64 tokens plus the steps taken) for several cache lengths S, bounded (`kv_bucket` 128) and
unbounded (`kv_bucket` 0, every S slot read), and reports per S both step times, the ratio
unbounded / bounded, and the bytes one step reads either way (weights + the KV read, the
memory roofline). Reference, measured in the same run: the unbounded step at the smallest S.

Usage: python benchmarks/decode_kv_bound.py [--model tiny|smollm2|HF_DIR] [--slots 32]
    [--lengths 128,512,2048] [--steps 24] [--dtype float32]
Prints one line per cache length, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
from common import model_path
from flax import nnx

from models.checkpoints.hf_io import load_hf_checkpoint
from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request


def step_time(
    cfg, model, prompts, slots: int, max_len: int, steps: int, kv_bucket: int
) -> tuple[float, int]:
    """Mean seconds of one decode step with every slot busy and a cache of ``max_len``
    positions, and the KV bytes one step reads (the bounded slots, or the whole cache)."""
    graphdef, params = nnx.split(model)
    bcfg = BatcherConfig(
        num_slots=slots, max_len=max_len, prefill_batch=8, steps_per_call=steps,
        kv_bucket=kv_bucket,
    )  # fmt: skip
    stops = StopConfig(eos_ids=(cfg.vocab_size,), pad_id=0)  # never sampled
    b = ContinuousBatcher(cfg, graphdef, params, bcfg, SamplingConfig(temperature=1.0), stops)
    budget = 2 * steps + 2  # never finishes within the two loops
    b.submit([Request(f"s{i}", prompts[i % len(prompts)], 1, budget) for i in range(slots)])
    b.step()  # fill, compile, `steps` steps
    jax.block_until_ready(b.state)
    kv_len = b.kv_len() or max_len
    before, t = b.decode_steps, time.perf_counter()
    b.step()
    jax.block_until_ready(b.state)
    seconds = (time.perf_counter() - t) / max(b.decode_steps - before, 1)
    kv = sum(int(x.nbytes) for x in jax.tree.leaves(b.state.cache)) * kv_len // max_len
    return seconds, kv


def main() -> None:
    """Times the decode step per cache length and prints the savings as JSON on the last line."""
    import numpy as np

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    lengths = sorted(int(x) for x in args.lengths.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        cfg, model = load_hf_checkpoint(model_path(args.model, Path(tmp)), dtype=args.dtype)
    rng = np.random.default_rng(0)
    prompts = [
        tuple(int(t) for t in rng.integers(1, cfg.vocab_size, int(rng.integers(16, 65))))
        for _ in range(args.slots)
    ]
    used = max(len(p) for p in prompts) + 2 * args.steps + 1  # largest position reached
    if lengths[0] < used:
        parser.error(f"the smallest length must hold the {used} positions used")
    param_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model)))
    rows = []
    for s in lengths:
        full_s, full_kv = step_time(cfg, model, prompts, args.slots, s, args.steps, 0)
        bound_s, bound_kv = step_time(cfg, model, prompts, args.slots, s, args.steps, 128)
        rows.append({"max_len": s, "unbounded_step_s": full_s, "bounded_step_s": bound_s,
                     "unbounded_kv_bytes": full_kv, "bounded_kv_bytes": bound_kv,
                     "unbounded_over_bounded": full_s / bound_s})  # fmt: skip
        print(
            f"S={s}: decode step {full_s * 1e3:.2f} ms reading all slots "
            f"({(param_bytes + full_kv) / 1e6:.0f} MB), {bound_s * 1e3:.2f} ms bounded "
            f"({(param_bytes + bound_kv) / 1e6:.0f} MB): {full_s / bound_s:.2f}x"
        )
    ref = rows[0]["unbounded_step_s"]
    for r in rows:
        r["bounded_over_reference"] = r["bounded_step_s"] / ref
    out = {
        "model": args.model,
        "dtype": args.dtype,
        "slots": args.slots,
        "used_positions": used,
        "param_bytes": param_bytes,
        "reference": f"unbounded step at S={lengths[0]}",
        "reference_step_s": ref,
        "rows": rows,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
