"""Where the JAX engine's decode step spends its time, fp32 against bf16, in one run.

On `--model` (default smollm2) loaded in each dtype, with a KV cache of `--rows` rows and
`--slots` slots (every row attending over all of them, as `rollout_throughput.py`'s step
timing), the median seconds of `--repeats` calls of each jitted piece of one decode step
(T = 1), timed in interleaved rounds (every piece of both dtypes once per round): ``step``
(the model's forward: hidden states and the LM head), ``hidden`` (the layers and final
norm, no LM head), ``lm_head`` (`Decoder.logits` on the hidden states), and
``attention`` (`models.layers.decode_attention` of one layer, times the layer count). The
remainder ``step - hidden - lm_head`` is what the jit boundary costs; ``hidden - attention``
is the projections, MLP, norms, rotary and the cache update.

Usage: python benchmarks/decode_pieces.py [--model smollm2|tiny|HF_DIR] [--rows 64]
    [--slots 192] [--repeats 7]
Prints one line per dtype and piece, then one JSON object on the last line: seconds per piece
and dtype (``fp32_step_s``, ``bf16_lm_head_s``, ...) and ``bf16_over_fp32_<piece>`` ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from common import model_path
from flax import nnx

from models.checkpoints.hf_io import load_hf_checkpoint
from models.kv_cache import KVCache
from models.layers import decode_attention


def interleaved_medians(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall seconds of each of `calls` (jitted, no arguments) over `repeats` rounds
    after one untimed call each; every round calls each once in turn, so a burst of load on
    this shared machine hits every piece and both dtypes alike."""
    for f in calls.values():
        jax.block_until_ready(f())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, f in calls.items():
            t = time.perf_counter()
            jax.block_until_ready(f())
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def pieces(
    path: Path, dtype: str, rows: int, slots: int
) -> tuple[dict[str, Callable[[], Any]], int]:
    """The jitted pieces of one decode step of `rows` rows over `slots` cache slots, each a
    call without arguments (keyed by piece name; ``attention`` is one layer's), and the
    model's layer count."""
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
    keys = jnp.ones((rows, k, slots, h), dt)  # the head-major cache (`models.kv_cache`)
    mask = jnp.ones((rows, slots), bool)
    attention = jax.jit(lambda q, kv: decode_attention(q, kv, kv, mask, cfg))
    h_states = hidden(params, cache)
    calls = {
        "step": lambda: step(params, cache),
        "hidden": lambda: hidden(params, cache),
        "lm_head": lambda: lm_head(params, h_states),
        "attention": lambda: attention(q, keys),
    }
    return calls, cfg.num_layers


def main() -> None:
    """Times every piece in fp32 then bf16 and prints the figures, JSON on the last line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--slots", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    out: dict[str, object] = {"model": args.model, "rows": args.rows, "slots": args.slots}
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        calls = {}
        for short, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
            by_piece, layers = pieces(path, dtype, args.rows, args.slots)
            for piece, f in by_piece.items():
                calls[f"{short}_{piece}"] = f
        seconds = interleaved_medians(calls, args.repeats)
    figures: dict[str, dict[str, float]] = {"fp32": {}, "bf16": {}}
    for name, sec in seconds.items():
        short, piece = name.split("_", 1)
        figures[short][piece] = sec * layers if piece == "attention" else sec
    for short, figure in figures.items():
        for piece, sec in figure.items():
            print(f"{short} {piece}: {sec * 1e3:.1f} ms", flush=True)
            out[f"{short}_{piece}_s"] = sec
    for piece in figures["fp32"]:
        out[f"bf16_over_fp32_{piece}"] = figures["bf16"][piece] / figures["fp32"][piece]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
