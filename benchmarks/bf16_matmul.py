"""The engine's bf16 projections: the native kernel (`models.kernels.bf16_matmul`), with the
weight packed per call and packed once beforehand (`bf16_matmul.pack`, as the engine holds it),
against XLA's float32-accumulated bf16 dot, on a model's projection shapes at decode row
counts, in one process.

Each figure is a jitted chain of one projection per layer (distinct random weights, so they
come from memory as in a decode step), run `--repeats` times alternating XLA and the kernel's
two forms; the median seconds per product give GFLOP/s (2 M K N per product). Shapes (`--model`):
`smollm2` (SmolLM2-135M: q/o 576 x 576, k/v 576 x 192, gate/up 576 x 1,536, down 1,536 x 576;
30 layers). Rows (`--rows`): 8, 64 and 128 by default (`models.layers.NATIVE_MATMUL_MAX_ROWS`
is where the engine stops taking the kernel).

Figures per shape and row count: `xla_gflop_per_s`, `native_gflop_per_s`,
`packed_gflop_per_s`, `native_over_xla` and `packed_over_xla` (XLA's seconds over the
kernel's: above 1 is faster). Without AVX512-BF16
the kernel is not available and only XLA is measured. Last line: one JSON object.

Usage: python benchmarks/bf16_matmul.py [--rows 8,64,128] [--repeats 7]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.kernels import bf16_matmul

SHAPES = {"q_o": (576, 576), "k_v": (576, 192), "gate_up": (576, 1536), "down": (1536, 576)}
LAYERS = 30


def _chain(mm: Callable[[jax.Array, jax.Array], jax.Array], n: int) -> Callable[..., jax.Array]:
    """Sum of ``mm(x, w)`` [M, n] over the weights, jitted."""

    @jax.jit
    def run(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        acc = jnp.zeros((x.shape[0], n), jnp.float32)
        for w in ws:
            acc = acc + mm(x, w)
        return acc

    return run


def _packed_matmul(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    return bf16_matmul.bf16_matmul_packed(x, packed, n)


def _seconds(fn: Callable[..., jax.Array], x: jax.Array, ws: list[jax.Array]) -> float:
    t0 = time.perf_counter()
    fn(x, ws).block_until_ready()
    return (time.perf_counter() - t0) / len(ws)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="8,64,128")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    native_ok = bf16_matmul.available()
    pack = jax.jit(bf16_matmul.pack)
    rng = np.random.default_rng(0)
    figures: dict[str, object] = {"native_available": native_ok}
    for rows in [int(r) for r in args.rows.split(",") if r]:
        for name, (k, n) in SHAPES.items():
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
            ws = [jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16) for _ in range(LAYERS)]
            xla = _chain(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32), n)
            kinds = {"xla": (xla, ws)}
            if native_ok:
                kinds["native"] = (_chain(bf16_matmul.bf16_matmul, n), ws)
                packed = _chain(functools.partial(_packed_matmul, n=n), n)
                kinds["packed"] = (packed, [pack(w) for w in ws])
            times: dict[str, list[float]] = {kind: [] for kind in kinds}
            for fn, operands in kinds.values():
                fn(x, operands).block_until_ready()  # compile
            for _ in range(args.repeats):
                for kind, (fn, operands) in kinds.items():
                    times[kind].append(_seconds(fn, x, operands))
            flop = 2 * rows * k * n
            row: dict[str, float] = {}
            for kind in kinds:
                row[f"{kind}_gflop_per_s"] = round(flop / statistics.median(times[kind]) / 1e9, 1)
            for kind in kinds.keys() - {"xla"}:
                ratio = statistics.median(times["xla"]) / statistics.median(times[kind])
                row[f"{kind}_over_xla"] = round(ratio, 3)
            figures[f"{name}_rows{rows}"] = row
            print(f"{name} [{rows}, {k}] x [{k}, {n}]: {row}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
