"""Issue 25 item 4(a): a checkpoint vLLM's CPU attention cannot run (head_dim 16; CPU_ATTN
supports 32, 64, 80, ...) is refused by ``python -m rollout_engine --backend vllm`` before
vLLM starts and before the engine registers: the process exits 1 naming the head size and the
supported ones, and the gateway (a real one on 127.0.0.1) saw no registration. Before, the
engine registered and its core died at the first forward pass, leaving an engine that
released or aborted every prompt it leased.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.auth import load_tokens, write_tokens
from gateway.config import GatewayConfig, RunSettings
from gateway.server import GatewayServer
from tests.integration.vllm_helpers import CPU_ENV

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]


def test_head_dim_16_is_refused_before_registration(tmp_path, tiny_checkpoint):
    model = tiny_checkpoint("llama", head_dim=16)  # 4 heads x 16 != hidden 64: explicit
    tokens = tmp_path / "tokens.txt"
    write_tokens(tokens)
    settings = RunSettings(model_family="llama")
    server = GatewayServer(GatewayConfig(settings=settings), load_tokens(tokens)).start()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "rollout_engine", "--backend", "vllm", "--gateway",
             server.address, "--token-file", str(tokens), "--model", str(model),
             "--dtype", "float32", "--log-level", "INFO"],
            cwd=REPO, env={**os.environ, **CPU_ENV}, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        out = done.stdout + done.stderr
        assert done.returncode == 1, out[-4000:]
        assert (
            f"the model at {model} has head_dim 16; vLLM's CPU attention (CPU_ATTN) supports "
            "head sizes [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512] only"
        ) in out, out[-4000:]
        assert "starting the vllm backend" not in out  # vLLM itself never started
        assert server.state.events.events("registered") == []
        assert server.state.status().engines == []
    finally:
        server.stop(0)
