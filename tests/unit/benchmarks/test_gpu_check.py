"""`benchmarks/gpu_check.sh --small` on this CPU: every part runs through the same code the GPU
check runs (train step, JAX engine decode, the jax_transfer push to a second process) and the
last line carries each part's figures; the CUDA IPC part says why it did not run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_gpu_check_small_runs_every_part_on_cpu():
    env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    done = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--small"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(result) == ["decode", "push", "train"]
    train, decode, push = result["train"], result["decode"], result["push"]
    assert train["backend"] == "cpu" and train["train_tokens_per_s"] > 0
    assert train["over_bf16_matmul"] > 0 and train["mfu"] > 0
    assert decode["decode_tokens_per_s"] > 0 and decode["roofline_fraction"] > 0
    assert push["push_bytes"] == 8 << 20 and push["jax_transfer_gb_per_s"] > 0
    assert push["ipc_gb_per_s"] is None and push["ipc_skipped"] == "no CUDA device"
