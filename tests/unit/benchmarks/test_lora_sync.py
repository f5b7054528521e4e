"""`benchmarks/weight_sync.py --lora RANK` as a user runs it: a bad engine is refused, and the
smallest run (the tiny SmolLM2-shaped model, the JAX engine, fp32) reports exact payloads: the
adapter push is A and B of every projection, the full push every tensor of the checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(BENCH / "weight_sync.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)


def test_a_bad_engine_or_model_is_refused():
    proc = _run("--lora", "4", "--engines", "sglang")
    assert proc.returncode == 2 and "--engines jax and/or vllm" in proc.stderr
    proc = _run("--lora", "4", "--models", "7b")
    assert proc.returncode == 2 and "--models takes one of" in proc.stderr


@pytest.mark.slow
def test_smallest_run_reports_exact_payloads(tmp_path):
    from models.checkpoints.peft_layout import adapter_shapes
    from models.checkpoints.tiny import make_tiny_checkpoint
    from models.config import ModelConfig
    from models.lora import TARGETS
    from transport.expected import checkpoint_tensors

    proc = _run("--lora", "4", "--engines", "jax", "--models", "tiny", "--repeats", "1",
                "--dtype", "float32")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    path = make_tiny_checkpoint(tmp_path / "tiny", "smollm2")  # the same model, rebuilt
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    adapter = sum(4 * int(np.prod(s)) for _, s in adapter_shapes(cfg, sorted(TARGETS), 4))
    full = sum(4 * int(np.prod(s)) for s, _ in checkpoint_tensors(path, "float32").values())
    jax = result["jax"]
    assert (jax["adapter"]["bytes"], jax["full"]["bytes"]) == (adapter, full)
    assert jax["bytes_ratio"] == adapter / full
    assert len(jax["adapter"]["pushes_s"]) == len(jax["full"]["pushes_s"]) == 1
    assert jax["seconds_ratio"] == jax["adapter"]["seconds"] / jax["full"]["seconds"]
