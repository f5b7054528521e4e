"""What a used-length bound on decode attention would save, in `rollout_throughput.py` terms.

`trainer/models/layers.py` attends over every one of the S cache positions of a slot at each
decode step, whatever the slot has used. A bound (attend only over positions below the batch's
largest used position, rounded up to a bucket) would make a step cost what a step with
``max_len`` = that bucket costs now. So this script times the JAX engine's decode step (the
same `ContinuousBatcher` set-up as `rollout_throughput.py`: every slot busy, one long sample
per slot, the mean step time of one compiled loop) at the same used positions (prompts of 16 to
64 tokens plus the steps taken) for several cache lengths S, and reports, per S, the step time,
the bytes one step reads (weights + the whole KV cache, the benchmark's memory roofline), and
the fraction a bound would save against the smallest S that holds the used positions
(the reference measured in the same run).

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
from flax import nnx

from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request
from trainer.checkpoints.hf_io import load_hf_checkpoint


def model_path(name: str, tmp: Path) -> Path:
    """The HF folder of ``name``: "tiny" (a random tiny llama), "smollm2", or a folder."""
    if name == "tiny":
        from trainer.checkpoints.tiny import make_tiny_checkpoint

        return make_tiny_checkpoint(tmp / "tiny", "llama", vocab_size=320)
    if name == "smollm2":
        from trainer.checkpoints.smollm2 import ensure_smollm2

        return ensure_smollm2()
    return Path(name)


def step_time(cfg, model, prompts, slots: int, max_len: int, steps: int) -> tuple[float, int]:
    """Mean seconds of one decode step with every slot busy and a cache of ``max_len``
    positions, and the KV cache bytes (the whole cache, read once per step)."""
    graphdef, params = nnx.split(model)
    bcfg = BatcherConfig(num_slots=slots, max_len=max_len, prefill_batch=8, steps_per_call=steps)
    stops = StopConfig(eos_ids=(cfg.vocab_size,), pad_id=0)  # never sampled
    b = ContinuousBatcher(cfg, graphdef, params, bcfg, SamplingConfig(temperature=1.0), stops)
    budget = 2 * steps + 2  # never finishes within the two loops
    b.submit([Request(f"s{i}", prompts[i % len(prompts)], 1, budget) for i in range(slots)])
    b.step()  # fill, compile, `steps` steps
    jax.block_until_ready(b.state)
    before, t = b.decode_steps, time.perf_counter()
    b.step()
    jax.block_until_ready(b.state)
    seconds = (time.perf_counter() - t) / max(b.decode_steps - before, 1)
    kv = sum(int(x.nbytes) for x in jax.tree.leaves(b.state.cache))
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
        seconds, kv = step_time(cfg, model, prompts, args.slots, s, args.steps)
        rows.append({"max_len": s, "step_s": seconds, "kv_bytes": kv})
        print(
            f"S={s}: decode step {seconds * 1e3:.2f} ms, reads {(param_bytes + kv) / 1e6:.0f} MB "
            f"(weights {param_bytes / 1e6:.0f} MB + KV {kv / 1e6:.0f} MB)"
        )
    ref = rows[0]
    for r in rows:
        r["bound_saves_fraction"] = 1.0 - ref["step_s"] / r["step_s"]
        r["bytes_ratio"] = (param_bytes + r["kv_bytes"]) / (param_bytes + ref["kv_bytes"])
        r["step_over_bounded"] = r["step_s"] / ref["step_s"]
    out = {
        "model": args.model,
        "dtype": args.dtype,
        "slots": args.slots,
        "used_positions": used,
        "param_bytes": param_bytes,
        "reference_max_len": ref["max_len"],
        "rows": rows,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
