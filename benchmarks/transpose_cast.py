"""Packing's transposed float32 -> bf16 cast: the native kernel (`transport.cast_kernel`) against
torch's two passes (`transport.base.copy_cast` with the kernel off: a contiguous cast into a
scratch tensor, then a transposed copy of 2-byte elements), in one process on one thread (the
sender packs on one thread beside the wire).

The matrices are a model's linear layers as the sender meets them: float32 JAX kernels
`[in, out]`, read as transposed views `[out, in]` into a reused bf16 buffer. Each layer's
seven matrices are separate arrays, and all layers together are larger than the caches, so
each pass reads its source from memory, as a push does. Shapes (`--model`): `smollm2`
(SmolLM2-135M: D 576, F 1,536, 9 heads, 3 KV heads of 64, 30 layers) or `llama_1b`
(Llama-3.2-1B: D 2,048, F 8,192, 32 heads, 8 KV heads of 64, 16 layers).

Figures: GB/s of bf16 written by each (median of `--repeats` passes over every layer),
`native_over_two_pass` (seconds of the two passes over the kernel's: above 1 is faster), and
`cpu_flags` (the AVX-512 flags the host has; without AVX-512F the kernel does not serve and
only the two passes are measured). Last line: one JSON object.

Usage: python benchmarks/transpose_cast.py [--model smollm2|llama_1b] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from models.kernels.build import cpu_flags
from transport import cast_kernel

SHAPES = {  # (D, F, query heads * head dim, KV heads * head dim, layers)
    "smollm2": (576, 1536, 576, 192, 30),
    "llama_1b": (2048, 8192, 2048, 512, 16),
}


def _layer_kernels(d: int, f: int, q: int, kv: int) -> list[torch.Tensor]:
    """One layer's JAX kernels [in, out], float32: q, k, v, o, gate, up, down."""
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    return [torch.randn(*s) for s in shapes]


def _pass(layers: list[list[torch.Tensor]], out: torch.Tensor, native: bool) -> float:
    """Seconds to cast every kernel's transposed view into `out` (reused)."""
    t0 = time.perf_counter()
    for kernels in layers:
        for k in kernels:
            view = k.T
            dst = out[: view.numel()].view(view.shape)
            if not (native and cast_kernel.transpose_cast(dst, view)):
                scratch = torch.empty(k.shape, dtype=torch.bfloat16)
                scratch.copy_(k)
                dst.copy_(scratch.T)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    d, f, q, kv, n_layers = SHAPES[args.model]
    layers = [_layer_kernels(d, f, q, kv) for _ in range(n_layers)]
    out_bytes = sum(k.numel() for k in layers[0]) * 2 * n_layers
    out = torch.zeros(max(k.numel() for k in layers[0]), dtype=torch.bfloat16)
    native_ok = cast_kernel.available()
    figures: dict[str, object] = {
        "model": args.model,
        "bytes_out": out_bytes,
        "native_available": native_ok,
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx"))),
    }
    kinds = ("two_pass", "native") if native_ok else ("two_pass",)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for kind in kinds:
        _pass(layers, out, kind == "native")  # warm-up: the build, first touches
    for _ in range(args.repeats):
        for kind in kinds:  # alternated, so both meet the same host load
            times[kind].append(_pass(layers, out, kind == "native"))
    for kind in kinds:
        s = statistics.median(times[kind])
        figures[f"{kind}_s"] = round(s, 4)
        figures[f"{kind}_gb_per_s"] = round(out_bytes / s / 1e9, 3)
        print(f"{kind}: {s * 1e3:.1f} ms for {out_bytes / 1e6:.0f} MB of bf16, "
              f"{out_bytes / s / 1e9:.2f} GB/s")  # fmt: skip
    if native_ok:
        ratio = figures["two_pass_s"] / figures["native_s"]  # type: ignore[operator]
        figures["native_over_two_pass"] = round(ratio, 3)
        print(f"native_over_two_pass (two-pass seconds / native seconds): {ratio:.2f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
