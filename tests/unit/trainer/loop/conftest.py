"""Fixtures of the loop tests: a real gateway server on loopback, an engine thread that leases
prompts and returns deterministic completions (the only stand-in: for the engine beside the loop),
a publisher that publishes versions through the gateway and waits for the engines' acks (no
weight bytes move: the stand-in engine has no weights), and a tiny compiled train step."""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from gateway import messages as m
from gateway.client import GatewayClient
from gateway.config import GatewayConfig, RunSettings
from gateway.server import GatewayServer

TOKENS = {"trainer": "trainer-token-0123456789", "engine": "engine-token-0123456789"}
TARGET = 7  # the token the token_fraction reward counts
OTHER = 5
ABORT_LAST = 11  # problem p8 of the tests (prompt [1, 2, 3 + 8])


def completions_for(prompt: m.Prompt, version: int) -> tuple[m.Completion, ...]:
    """G completions of 4 tokens. Prompts whose last token is a multiple of 3 get G copies of
    [7, 7, 5, 5] (reward 0.5 each: zero variance); a prompt ending in ABORT_LAST gets G empty
    "abort" completions (as an engine refusing it); others get completion j = [7]*j + [5]*(4-j)
    (reward j/4). Log-probs -1.0; versions = the engine's loaded version."""
    last = int(prompt.token_ids[-1])
    if last == ABORT_LAST:
        empty = m.Completion(
            np.zeros(0, np.int32), np.zeros(0, np.float32), "abort", version, version
        )
        return (empty,) * prompt.group_size
    rows = []
    for j in range(prompt.group_size):
        hits = 2 if last % 3 == 0 else j
        tokens = [TARGET] * hits + [OTHER] * (4 - hits)
        rows.append(
            m.Completion(
                token_ids=np.array(tokens, np.int32),
                logprobs=np.full(4, -1.0, np.float32),
                finish_reason="length",
                version_start=version,
                version_end=version,
            )
        )
    return tuple(rows)


class EngineThread(threading.Thread):
    """Registers as a JAX engine, leases prompts (only those its version may serve), returns
    `completions_for` each at once, and acknowledges new versions ("ready", then "loaded")."""

    def __init__(self, address: str):
        super().__init__(name="test-engine", daemon=True)
        self.client = GatewayClient(address, TOKENS["engine"], margin_s=5.0)
        self.stop_event = threading.Event()
        self.loaded = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            spec = m.EngineSpec(
                backend="jax", model_family="llama", dtype="float32", transports=("gloo",)
            )
            reg = self.client.register_engine(spec, wait_s=5.0)
            eid, self.loaded = reg.engine_id, reg.current_version
            while not self.stop_event.is_set():
                lease = self.client.lease_prompts(eid, max_prompts=8, timeout_s=0.1)
                if lease.prompts:
                    groups = [
                        m.RolloutGroup(p.sample_id, completions_for(p, self.loaded))
                        for p in lease.prompts
                    ]
                    self.client.return_rollouts(eid, lease.lease_id, groups)
                if lease.sync is not None and lease.sync.target_version > self.loaded:
                    target = lease.sync.target_version
                    self.client.ack_version(eid, target, "ready")
                    self.client.ack_version(eid, target, "loaded")
                    self.loaded = target
                if lease.shutting_down:
                    return
        except BaseException as err:
            self.error = err

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)
        self.client.close()


class VersionPublisher:
    """Publishes each version on the gateway and waits until every engine loaded it; sleeps
    `delay_s` first (a slow trainer). Records (version, sum of the LM head) per push."""

    def __init__(self, client: GatewayClient, delay_s: float = 0.0):
        self.client = client
        self.delay_s = delay_s
        self.pushed: list[tuple[int, float]] = []

    def push(self, model, version: int) -> None:
        time.sleep(self.delay_s)
        self.client.publish_version(version)
        result = self.client.wait_sync(version, timeout_s=10.0)
        if not result.done:
            raise RuntimeError(f"engines did not load version {version}: {result.engines}")
        self.pushed.append((version, float(np.asarray(model.lm_head_weight()).sum())))


@pytest.fixture
def gateway_run():
    """(server, trainer client, engine thread) on loopback; stopped after the test."""
    config = GatewayConfig(
        settings=RunSettings(model_family="llama"),
        lease_seconds=30.0,
        heartbeat_timeout_s=10.0,
        max_wait_s=5.0,
    )
    server = GatewayServer(config, TOKENS).start()
    trainer = GatewayClient(server.address, TOKENS["trainer"], margin_s=5.0)
    engine = EngineThread(server.address)
    engine.start()
    yield server, trainer, engine
    engine.stop()
    trainer.close()
    server.stop(0)
    assert engine.error is None, engine.error


@pytest.fixture
def kit() -> types.SimpleNamespace:
    """The constants and classes of this module: TARGET, TOKENS, VersionPublisher."""
    return types.SimpleNamespace(TARGET=TARGET, TOKENS=TOKENS, VersionPublisher=VersionPublisher)


@pytest.fixture(scope="module")
def tiny_step():
    """(model, TrainStep) on one device, built from the config (GRPO, lr 1e-3, temperature 1),
    compiled once per module."""
    import jax
    from flax import nnx

    from models.checkpoints.tiny import TINY_CONFIGS
    from models.config import ModelConfig
    from models.decoder import Decoder
    from models.sharding import make_mesh
    from trainer.build import train_step_from_config
    from trainer.config import load_config

    hf = dict(TINY_CONFIGS["llama"], vocab_size=64, max_position_embeddings=128)
    model = Decoder(ModelConfig.from_hf(hf), rngs=nnx.Rngs(0))
    cfg = load_config(overrides=["optim.learning_rate=1e-3", "trainer.logprob_chunk_size=16"])
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    return model, train_step_from_config(cfg, model, mesh)
