"""The real loop's outside for the learning tests: a gateway on loopback, one
`python -m rollout_engine` process of either backend and a gloo weight publisher, all shut
down (the engine waited for, killed if it will not stop) on every way out."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from gateway import messages as m
from gateway.client import GatewayClient
from gateway.config import GatewayConfig, RunSettings
from gateway.server import GatewayServer
from models.config import ModelConfig
from tests.integration.smoke_job import child_env
from trainer.publish import WeightPublisher
from transport.config import GlooTransportConfig

_spec = importlib.util.spec_from_file_location("waits", Path(__file__).with_name("waits.py"))
assert _spec is not None and _spec.loader is not None
waits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(waits)

TOKENS = {"trainer": "trainer-token-0123456789", "engine": "engine-token-0123456789"}
CPU_VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


@contextlib.contextmanager
def engine_loop(
    tmp_path: Path, backend: str, ckpt: Path, engine_args: Sequence[str], model_cfg: ModelConfig
) -> Iterator[tuple[GatewayClient, WeightPublisher]]:
    """A gateway, one fp32 engine of `backend` serving the llama checkpoint `ckpt` (registered
    before this yields) and a gloo publisher of `model_cfg`: yields (trainer client,
    publisher)."""
    token_file = tmp_path / "tokens.txt"
    token_file.write_text("".join(f"{k}={v}\n" for k, v in TOKENS.items()))
    server = GatewayServer(
        GatewayConfig(settings=RunSettings(model_family="llama", dtype="float32"), max_wait_s=5.0),
        TOKENS,
    ).start()
    client = GatewayClient(server.address, TOKENS["trainer"], margin_s=5.0)
    client.configure(m.RunSettings(model_family="llama", dtype="float32", transport="gloo"))
    engine = subprocess.Popen(
        [
            sys.executable, "-m", "rollout_engine", "--backend", backend,
            "--gateway", server.address, "--token-file", str(token_file), "--model", str(ckpt),
            "--dtype", "float32", "--transports", "gloo", "--log-level", "WARNING",
            *engine_args,
        ],
        env=child_env() | CPU_VLLM_ENV,
    )  # fmt: skip
    publisher = WeightPublisher(client, GlooTransportConfig(), "llama", model_cfg, "float32")
    try:
        # a start-up on a loaded machine may take minutes: wait while the engine is alive
        waits.wait_for(lambda: client.status().engines, [engine], "the engine's registration")
        yield client, publisher
    finally:
        publisher.close()
        client.shutdown("test over")
        try:
            waits.exit_status(engine, "the engine's exit after the gateway's shutdown")
        finally:
            if engine.poll() is None:
                engine.kill()
                engine.wait()
            client.close()
            server.stop(0)
