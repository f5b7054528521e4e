"""`benchmarks/model_scale.py` as a user runs it: bad flags fail with the known names, and a
compile-only run plans at least the params and both Adam moments in fp32 (XLA's compiled
plan, not a timing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "model_scale.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--models", "gpt2"), "--models: unknown ['gpt2']; known: ['llama_1b', 'smollm2_360m']"),
        (("--precisions", "fp16"), "--precisions: unknown ['fp16']"),
        (("--layouts", "unrolled"), "--layouts: unknown ['unrolled']; known: ['loop', 'scan']"),
        (("--steps", "0"), "need --steps >= 1, --seq-len >= 8 and --lora >= 0"),
    ],
)
def test_bad_flags_name_what_is_known(args, message):
    proc = _run(*args)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.slow
def test_compile_only_plans_params_and_moments():
    """SmolLM2-360M's shape at fp32, scan, compile only: the plan holds at least params and two
    moments (3 x 4 bytes x 361.8 M params = 4.04 GiB) and no step runs; its rank-16 LoRA step
    (`--lora 16`) plans under half of that: the base's params without gradients or moments."""
    proc = _run(
        "--models", "smollm2_360m", "--precisions", "fp32", "--layouts", "scan",
        "--depths", "", "--no-run", "--seq-len", "64", "--lora", "16",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    config, lora = last["configs"]
    assert config["params"] == 361_821_120 and config["layers"] == 32 and config["scan"]
    assert config["planned_gib"] >= 3 * 4 * config["params"] / (1 << 30)
    assert config["compile_s"] > 0 and "step_s" not in config
    assert (config["lora"], lora["lora"]) == (0, 16)
    assert 4 * config["params"] / (1 << 30) < lora["planned_gib"] < 0.5 * config["planned_gib"]
    ratio = last["ratios"]["smollm2_360m_fp32_lora_over_full_planned"]
    assert ratio == pytest.approx(lora["planned_gib"] / config["planned_gib"], abs=2e-3)
