"""`benchmarks/moe.py` as a user runs it: a bad flag fails naming what is known, and the
smallest run reports both models' push payloads exactly (bf16 bytes of every param) and a
tokens/s ratio for the dispatch asked for."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from tests.unit.benchmarks.loading import BENCHMARKS as BENCH
from tests.unit.benchmarks.loading import load_benchmark


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(BENCH / "moe.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)


def test_unknown_dispatch_is_refused():
    proc = _run("--dispatch", "dense,capacity")
    assert proc.returncode == 2
    assert "--dispatch: unknown ['capacity']; known: ['dense', 'grouped']" in proc.stderr


@pytest.mark.slow
def test_smallest_run_reports_exact_payloads():
    model_config = load_benchmark("moe").model_config
    from models.decoder import Decoder
    from models.params import flat_params

    proc = _run("--layers", "1", "--batch", "4", "--seq-len", "16", "--steps", "1",
                "--dispatch", "dense")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    want = {}
    for kind in ("dense", "moe"):
        model = Decoder(model_config(kind, 1), rngs=nnx.Rngs(0))
        want[kind] = 2 * sum(int(np.prod(v.shape)) for v in flat_params(model).values())
        assert result[f"{kind}_push_bytes"] == want[kind]
    # the MoE's MLP holds E / k = 4 times the dense MLP's weights, plus a router per layer
    d, e, w = 256, 8, 256
    assert want["moe"] - want["dense"] == 2 * (3 * d * w * e - 3 * d * 2 * w + d * e)
    assert result["moe_over_dense_push_bytes"] == round(want["moe"] / want["dense"], 4)
    assert result["moe_dense_over_dense_tokens_per_s"] > 0
    assert "moe_grouped_tokens_per_s" not in result
