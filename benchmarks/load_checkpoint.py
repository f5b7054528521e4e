"""Seconds and GB/s to load SmolLM2-135M-Instruct into JAX params, against reading the same
bytes with safetensors alone in the same run.

Usage: python benchmarks/load_checkpoint.py [--path HF_DIR] [--repeats 3]
Prints one line per run, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open

from models.checkpoints.hf_io import load_hf_checkpoint
from models.checkpoints.smollm2 import ensure_smollm2
from models.params import flat_params


def read_raw(path: Path) -> int:
    """Reads every tensor of the folder with safetensors alone; returns the bytes read."""
    total = 0
    with safe_open(path / "model.safetensors", framework="np") as f:
        for name in f.keys():
            total += np.ascontiguousarray(f.get_tensor(name)).nbytes
    return total


def load_jax(path: Path) -> int:
    """Loads the folder into a Decoder (mapped, cast, placed); returns the param bytes."""
    _, model = load_hf_checkpoint(path)
    params = flat_params(model)
    jax.block_until_ready(params)
    return sum(int(v.nbytes) for v in params.values())


def main() -> None:
    """Times both paths `--repeats` times (after one warm-up each) and prints the medians."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = args.path or ensure_smollm2()
    read_raw(path)
    load_jax(path)
    raw_s, jax_s = [], []
    nbytes = 0
    for i in range(args.repeats):
        t = time.perf_counter()
        nbytes = read_raw(path)
        raw_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        load_jax(path)
        jax_s.append(time.perf_counter() - t)
        print(f"run {i}: safetensors {raw_s[-1]:.3f} s, JAX load {jax_s[-1]:.3f} s")
    raw, jx = statistics.median(raw_s), statistics.median(jax_s)
    result = {
        "benchmark": "load_checkpoint",
        "model": path.name,
        "bytes": nbytes,
        "jax_load_s": round(jx, 4),
        "jax_load_GBps": round(nbytes / jx / 1e9, 3),
        "safetensors_read_s": round(raw, 4),
        "safetensors_read_GBps": round(nbytes / raw / 1e9, 3),
        "ratio_jax_over_safetensors_time": round(jx / raw, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
