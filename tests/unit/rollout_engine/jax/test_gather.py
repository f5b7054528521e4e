"""An idle JAX engine takes a burst of requests that arrive one by one (a group's episodes
sending their next turns) into one decode call: every sample starts at the same step, so the
burst decodes ``max_new_tokens - 1`` steps in all, and each sample is the one it is alone."""

import threading
import time

import jax
import pytest
from flax import nnx

from models.checkpoints.tiny import TINY_CONFIGS
from models.config import ModelConfig
from models.decoder import Decoder
from rollout_engine.jax.batcher import BatcherConfig
from rollout_engine.jax.engine import EngineConfig, JaxEngine
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

PROMPTS = [(5, 9, 17), (22, 40, 7, 3), (11, 12), (30, 31, 32, 33, 34)]


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.from_hf(dict(TINY_CONFIGS["llama"], vocab_size=64, eos_token_id=0))
    return cfg, nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))[1]


def _engine(tiny, gather_s: float) -> JaxEngine:
    cfg, params = tiny
    batcher = BatcherConfig(num_slots=4, max_len=32, prefill_batch=4, steps_per_call=2)
    stops = StopConfig(eos_ids=(cfg.vocab_size,), pad_id=1)
    ecfg = EngineConfig(batcher, SamplingConfig(temperature=1.0), stops, gather_s=gather_s)
    return JaxEngine(cfg, params, ecfg, devices=jax.devices()[:1])


def _requests() -> list[Request]:
    return [Request(f"r{i}", p, 1, 10, seed=i) for i, p in enumerate(PROMPTS)]


def test_an_idle_engine_takes_a_burst_arriving_one_by_one_whole(tiny) -> None:
    with _engine(tiny, gather_s=0.0) as engine:  # all submitted at once: the reference
        alone = {r.prompt_id: r.tokens.tolist() for r in engine.generate(_requests())}
    with _engine(tiny, gather_s=5.0) as engine:

        def arrive() -> None:
            for r in _requests():
                engine.submit([r])
                time.sleep(0.05)  # one by one, each well inside the gather window

        sender = threading.Thread(target=arrive)
        sender.start()
        got: dict = {}
        while len(got) < len(PROMPTS):
            got |= {r.prompt_id: r.tokens.tolist() for r in engine.poll(timeout=1.0)}
        sender.join()
        assert engine.replicas[0].decode_steps == 10 - 1  # all four started together
    assert got == alone
