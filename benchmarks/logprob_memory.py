"""Peak memory and time of the fused log-prob kernel against the naive path (forward + backward).

Memory is XLA's planned temporary allocation of the compiled gradient function
(``compiled.memory_analysis().temp_size_in_bytes``: every intermediate buffer, excluding inputs
and outputs), which on CPU is the honest peak (the CPU client has no allocator statistics).
Time is the median of `--repeats` runs after compilation. Shapes: N rows of width D (SmolLM2-135M's
576 by default) against V = 49,152 (SmolLM2) and V = 151,936 (Qwen2/3).

Last line: one JSON object with, per V, both paths' bytes and seconds and the ratios
fused / naive.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from common import compiled_temp_and_seconds

from trainer.logprobs import fused_target_logprobs, naive_target_logprobs


def _grad_fn(fn, **kw):
    def loss(h, w, y, cot):
        return jnp.sum(fn(h, w, y, **kw) * cot)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def measure(fn, args, repeats: int, **kw) -> dict[str, float]:
    """Compiled temp bytes and median seconds of value-and-grad of sum(fn(...) * cot)."""
    return compiled_temp_and_seconds(_grad_fn(fn, **kw), args, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048, help="N = B * T rows")
    parser.add_argument("--width", type=int, default=576, help="D, the model width")
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    results = {}
    for v in args.vocab:
        k1, k2, k3, k4 = jax.random.split(jax.random.key(v), 4)
        h = jax.random.normal(k1, (args.rows, args.width), jnp.float32)
        w = jax.random.normal(k2, (args.width, v), jnp.float32) * 0.02
        y = jax.random.randint(k3, (args.rows,), 0, v, jnp.int32)
        cot = jax.random.normal(k4, (args.rows,), jnp.float32)
        fused = measure(
            fused_target_logprobs, (h, w, y, cot), args.repeats, chunk_size=args.chunk_size
        )
        naive = measure(naive_target_logprobs, (h, w, y, cot), args.repeats)
        row = {
            "fused": fused,
            "naive": naive,
            "memory_ratio_fused_over_naive": fused["temp_bytes"] / naive["temp_bytes"],
            "time_ratio_fused_over_naive": fused["seconds"] / naive["seconds"],
        }
        results[str(v)] = row
        print(
            f"V={v}: fused {fused['temp_bytes'] / 2**20:.1f} MiB {fused['seconds']:.3f} s, "
            f"naive {naive['temp_bytes'] / 2**20:.1f} MiB {naive['seconds']:.3f} s",
            flush=True,
        )
    summary = {
        "benchmark": "logprob_memory",
        "rows": args.rows,
        "width": args.width,
        "chunk_size": args.chunk_size,
        "backend": jax.default_backend(),
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
