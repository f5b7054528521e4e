"""Where the JAX engine's decode step spends its time, fp32 against bf16, in one run.

On `--model` (default smollm2) loaded in each dtype, with a KV cache of `--rows` rows and
`--slots` slots (every row attending over all of them, as `rollout_throughput.py`'s step
timing), the median seconds of `--repeats` calls of each jitted piece of one decode step
(T = 1): ``step`` (the model's forward: hidden states and the LM head), ``hidden`` (the layers
and final norm, no LM head), ``lm_head`` (`Decoder.logits` on the hidden states), and
``attention`` (`models.layers.decode_attention` of one layer, times the layer count). The
remainder ``step - hidden - lm_head`` is what the jit boundary costs; ``hidden - attention``
is the projections, MLP, norms, rotary and the cache update.

Usage: python benchmarks/decode_pieces.py [--model smollm2|tiny|HF_DIR] [--rows 64]
    [--slots 192] [--repeats 5]
Prints one line per dtype and piece, then one JSON object on the last line: seconds per piece
and dtype (``fp32_step_s``, ``bf16_lm_head_s``, ...) and ``bf16_over_fp32_<piece>`` ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from common import model_path
from flax import nnx

from models.checkpoints.hf_io import load_hf_checkpoint
from models.kv_cache import KVCache
from models.layers import decode_attention


def median_s(f, *args, repeats: int) -> float:
    """Median wall seconds of `repeats` calls of jitted `f(*args)` after one untimed call."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def pieces(path: Path, dtype: str, rows: int, slots: int, repeats: int) -> dict[str, float]:
    """Seconds of each piece of one decode step of `rows` rows over `slots` cache slots."""
    cfg, model = load_hf_checkpoint(path, dtype=dtype)
    graphdef, params = nnx.split(model)
    cache = KVCache.init(cfg, rows, slots)
    tokens = jnp.ones((rows, 1), jnp.int32)
    positions = jnp.full((rows, 1), slots - 1, jnp.int32)

    @jax.jit
    def step(p, c):
        return nnx.merge(graphdef, p)(tokens, positions, c)[0]

    @jax.jit
    def hidden(p, c):
        return nnx.merge(graphdef, p).hidden(tokens, positions, c)[0]

    @jax.jit
    def lm_head(p, h):
        return nnx.merge(graphdef, p).logits(h)

    dt = jnp.dtype(cfg.dtype)
    k, g, h = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    q = jnp.ones((rows, 1, k, g, h), dt)
    keys = jnp.ones((rows, slots, k, h), dt)
    mask = jnp.ones((rows, slots), bool)
    attention = jax.jit(lambda q, kv: decode_attention(q, kv, kv, mask, cfg))

    h_states = hidden(params, cache)
    return {
        "step": median_s(step, params, cache, repeats=repeats),
        "hidden": median_s(hidden, params, cache, repeats=repeats),
        "lm_head": median_s(lm_head, params, h_states, repeats=repeats),
        "attention": cfg.num_layers * median_s(attention, q, keys, repeats=repeats),
    }


def main() -> None:
    """Times every piece in fp32 then bf16 and prints the figures, JSON on the last line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--slots", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    out: dict[str, object] = {"model": args.model, "rows": args.rows, "slots": args.slots}
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        figures = {}
        for short, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
            figures[short] = pieces(path, dtype, args.rows, args.slots, args.repeats)
            for piece, s in figures[short].items():
                print(f"{short} {piece}: {s * 1e3:.1f} ms", flush=True)
                out[f"{short}_{piece}_s"] = s
    for piece in figures["fp32"]:
        out[f"bf16_over_fp32_{piece}"] = figures["bf16"][piece] / figures["fp32"][piece]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
