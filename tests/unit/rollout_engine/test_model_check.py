"""An engine started by hand holds its model folder against its family's mapping before it
contacts the gateway: a folder missing one tensor (which vLLM would load with a warning and
serve) is refused in one error naming the tensor, and the engine never registers."""

import subprocess
import sys

import pytest
from safetensors.numpy import load_file, save_file

from gateway.auth import write_tokens
from gateway.client import GatewayClient
from gateway.config import GatewayConfig, RunSettings
from gateway.server import GatewayServer
from rollout_engine.model_check import ModelRefused, check_model

DROPPED = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture
def broken(tmp_path, tiny_checkpoint):
    """The tiny llama checkpoint without DROPPED."""
    model = tiny_checkpoint("llama")
    folder = tmp_path / "broken"
    folder.mkdir()
    tensors = {}
    for f in model.iterdir():
        if f.suffix == ".safetensors":
            tensors.update(load_file(f))
        else:
            (folder / f.name).write_bytes(f.read_bytes())
    del tensors[DROPPED]
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_check_model_names_the_missing_tensor(broken, tiny_checkpoint):
    check_model(tiny_checkpoint("llama"), "llama")  # the whole folder passes
    with pytest.raises(ModelRefused) as caught:
        check_model(broken, "llama")
    assert str(caught.value) == (
        f"model {str(broken)!r} does not match the llama mapping; the engine did not start or "
        f"register:\n  missing: {DROPPED} (for layers.0.mlp.up.kernel)"
    )


def test_hand_started_vllm_engine_refuses_a_broken_folder_before_it_registers(tmp_path, broken):
    tokens = tmp_path / "tokens.txt"
    srv = GatewayServer(
        GatewayConfig(settings=RunSettings(model_family="llama")), write_tokens(tokens)
    ).start()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "rollout_engine", "--backend", "vllm", "--gateway",
             srv.address, "--token-file", str(tokens), "--model", str(broken),
             "--log-level", "WARNING"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 1
        first, second = done.stderr.splitlines()  # the whole output: one error, two lines
        assert first.endswith(
            f"rollout_engine ERROR model {str(broken)!r} does not match the llama mapping; the "
            "engine did not start or register:"
        )
        assert second == f"  missing: {DROPPED} (for layers.0.mlp.up.kernel)"
        with GatewayClient.from_token_file(srv.address, tokens, "trainer") as client:
            assert len(client.status().engines) == 0
    finally:
        srv.stop(0)
