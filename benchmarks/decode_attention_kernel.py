"""The decode step's attention over a bits KV cache: the native CPU kernel against XLA's path,
in one run.

`--layers` layers in a chain (each layer's output is the next one's query, as in a decode
step, so no two layers' attention overlap), each over its own uint16 cache of `--rows` rows x
`--slots` slots (SmolLM2's K = 3, G = 3, H = 64 by default), every row at position
`--position`: XLA's path (`models.layers.decode_attention` over the cache sliced to the
`kv_len` bucket that holds the position and bitcast to bfloat16, as the engine's decode step
calls it) against `models.kernels.decode_attention.bits_decode_attention` (the visible slots
read in place). Median of `--repeats` interleaved calls each.

Usage: python benchmarks/decode_attention_kernel.py [--rows 128] [--slots 288]
    [--position 200] [--layers 30] [--repeats 7]
Last line: one JSON object with ``xla_s``, ``kernel_s`` (seconds for all layers),
``kernel_over_xla`` (time ratio, < 1: the kernel is faster), ``kernel_GBps`` (cache bytes
the kernel reads per second) and the largest difference of the outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.kernels.decode_attention import available, bits_decode_attention
from models.kv_cache import from_storage
from models.layers import decode_attention


def main() -> None:
    """Times both paths and prints their figures, JSON on the last line."""
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--slots", type=int, default=288)
    p.add_argument("--position", type=int, default=200)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args()
    if not available():
        raise SystemExit("the native kernel is not available here (no g++, or not a CPU)")
    B, K, G, S, H = a.rows, a.kv_heads, a.group, a.slots, a.head_dim
    cfg = ModelConfig(family="llama", vocab_size=1, hidden_size=K * G * H, intermediate_size=1,
                      num_layers=a.layers, num_heads=K * G, num_kv_heads=K, head_dim=H,
                      query_scale=H**-0.5, dtype="bfloat16",
                      layer_types=("full_attention",) * a.layers)  # fmt: skip
    kv_len = 128
    while kv_len <= a.position and kv_len < S:
        kv_len *= 2
    kv_len = min(kv_len, S)
    rng = np.random.default_rng(0)

    def bits() -> jax.Array:
        x = jnp.asarray(rng.standard_normal((B, K, S, H), np.float32), jnp.bfloat16)
        return jax.lax.bitcast_convert_type(x, jnp.uint16)

    caches = [(bits(), bits()) for _ in range(a.layers)]
    q = jnp.asarray(rng.standard_normal((B, 1, K, G, H), np.float32), jnp.bfloat16)
    pos = jnp.full((B,), a.position, jnp.int32)
    mask = jnp.arange(kv_len)[None, :] <= pos[:, None]  # [B, kv_len]

    def xla(q, k, v):  # type: ignore[no-untyped-def]
        k, v = (
            from_storage(k[:, :, :kv_len], jnp.bfloat16),
            from_storage(v[:, :, :kv_len], jnp.bfloat16),
        )
        return decode_attention(q, k, v, mask, cfg)

    def kernel(q, k, v):  # type: ignore[no-untyped-def]
        return bits_decode_attention(q, k, v, pos, cfg, None)

    def chain(fn):  # type: ignore[no-untyped-def]
        def run(q, caches):  # type: ignore[no-untyped-def]
            for k, v in caches:
                q = fn(q, k, v).astype(q.dtype)
            return q

        return jax.jit(run)

    calls = {"xla": chain(xla), "kernel": chain(kernel)}
    outs = {name: np.asarray(f(q, caches), np.float32) for name, f in calls.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(a.repeats):
        for name, f in calls.items():
            t = time.perf_counter()
            jax.block_until_ready(f(q, caches))
            times[name].append(time.perf_counter() - t)
    sec = {name: statistics.median(ts) for name, ts in times.items()}
    read = 2 * B * K * (a.position + 1) * H * 2 * a.layers  # keys and values, bf16 bytes
    for name, s in sec.items():
        print(f"{name}: {s * 1e3:.1f} ms for {a.layers} layers", flush=True)
    out = {
        "rows": B, "slots": S, "position": a.position, "kv_len": kv_len, "layers": a.layers,
        "xla_s": sec["xla"], "kernel_s": sec["kernel"],
        "kernel_over_xla": sec["kernel"] / sec["xla"],
        "kernel_GBps": read / sec["kernel"] / 1e9,
        "max_abs_diff": float(np.abs(outs["kernel"] - outs["xla"]).max()),
    }  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
