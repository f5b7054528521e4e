"""The JAX engine records routes (routing replay): for a mixture-of-experts model every sample
carries the experts its prefill and decode passes chose, one row per token fed (prompt, then
completion but the last), equal to a full forward's choices over the same tokens; the backend
returns them only when the prompt asks, never for a dense model, and refuses them for a
continued prompt."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gateway import messages as m
from models.checkpoints.hf_io import load_hf_checkpoint
from models.routing import forward_with_routing
from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig
from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

PROMPTS = [(5, 17, 230, 44, 9), tuple(range(40, 51)), (7, 300, 12)]


def _batcher(cfg, model) -> ContinuousBatcher:
    graphdef, params = nnx.split(model)
    return ContinuousBatcher(  # 2 slots for 6 samples: substitution mid-flight
        cfg, graphdef, params, BatcherConfig(num_slots=2, max_len=64, prefill_batch=2),
        SamplingConfig(temperature=1.0), StopConfig(eos_ids=(0,), pad_id=0),
    )  # fmt: skip


@pytest.mark.parametrize("variant", ["qwen3_moe", "olmoe"])
def test_every_sample_carries_the_routes_of_its_passes(variant, tiny_checkpoint):
    cfg, model = load_hf_checkpoint(tiny_checkpoint(variant))
    b = _batcher(cfg, model)
    b.submit([Request(f"r{i}", p, 2, 9 + 3 * i, seed=i) for i, p in enumerate(PROMPTS)])
    results = b.run_until_idle()
    assert len(results) == 6
    rows = 0
    for r in results:
        prompt = PROMPTS[int(str(r.prompt_id)[1:])]
        fed = [*prompt, *r.tokens[:-1].tolist()]
        assert r.routes is not None
        assert r.routes.shape == (len(fed), cfg.num_layers, cfg.num_experts_per_tok)
        seq = jnp.asarray([fed], jnp.int32)
        _, _, record = forward_with_routing(model, seq, jnp.arange(len(fed))[None])
        want = np.sort(np.asarray(record.expert_ids[0]), axis=-1)
        np.testing.assert_array_equal(np.sort(r.routes, axis=-1), want)
        rows += len(fed)
    print(f"{variant}: {rows} route rows equal to a full forward's")


def test_a_dense_model_records_no_routes(tiny_checkpoint):
    cfg, model = load_hf_checkpoint(tiny_checkpoint("qwen3"))
    b = _batcher(cfg, model)
    b.submit([Request("r", PROMPTS[0], 1, 4, seed=0)])
    (r,) = b.run_until_idle()
    assert r.routes is None and b.state.out_routes.shape == (2, 0, 0, 0)


def test_the_backend_returns_routes_only_when_asked(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    cfg = load_hf_checkpoint(path)[0]
    backend = JaxBackend(JaxBackendConfig(model=str(path), num_slots=2, max_model_len=64))

    def prompt(sid: str, routes: bool, continues: bool = False) -> m.Prompt:
        s = m.SamplingParams(max_new_tokens=5, return_routes=routes)
        return m.Prompt(sid, np.asarray(PROMPTS[0], np.int32), 2, s, continues=continues)

    async def scenario():
        await backend.start()
        try:
            asked = await backend.generate(prompt("a", True))
            plain = await backend.generate(prompt("b", False))
            with pytest.raises(ValueError, match="routes of a continued prompt"):
                await backend.generate(prompt("c", True, continues=True))
            return asked, plain
        finally:
            await backend.shutdown()

    asked, plain = asyncio.run(scenario())
    for c in asked:
        rows = len(PROMPTS[0]) + len(c.token_ids) - 1
        assert c.routed_experts is not None
        assert c.routed_experts.shape == (rows, cfg.num_layers, cfg.num_experts_per_tok)
    assert all(c.routed_experts is None for c in plain)
