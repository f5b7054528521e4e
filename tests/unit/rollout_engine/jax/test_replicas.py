"""One replica, several replicas and the data-parallel (sharded) mode on the 8 CPU devices give
the same samples; weight updates switch at safe points, are stamped, and copy nothing."""

import jax
import numpy as np
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

EOS = 0


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.from_hf(dict(TINY_CONFIGS["qwen2"], vocab_size=64, eos_token_id=EOS))
    return cfg, nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))[1]


def _requests(seed: int, n: int, g: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [
        Request(
            f"p{i}",
            tuple(int(t) for t in rng.integers(1, 64, size=int(rng.integers(2, 20)))),
            num_samples=g,
            max_new_tokens=int(rng.integers(4, 20)),
        )
        for i in range(n)
    ]


def _run(tiny, sampling, replicas, devices_per_replica, slots, requests):
    cfg, params = tiny
    ecfg = EngineConfig(
        BatcherConfig(num_slots=slots, max_len=48, prefill_batch=2, steps_per_call=8),
        sampling,
        StopConfig(eos_ids=(EOS,), pad_id=1),
        replicas=replicas,
        devices_per_replica=devices_per_replica,
    )
    with JaxEngine(cfg, params, ecfg) as engine:
        results = engine.generate(requests)
        used = {r.replica for r in results}
    return results, used


@pytest.mark.parametrize(
    ("sampling", "layouts"),
    [
        # (replicas, devices per replica, slots per replica)
        (SamplingConfig(temperature=0.0), [(1, 1, 4), (2, 1, 2), (1, 8, 8)]),
        pytest.param(
            SamplingConfig(temperature=1.0),
            [(1, 1, 4), (2, 1, 2), (1, 8, 8), (2, 4, 4)],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_single_several_and_sharded_replicas_agree(tiny, sampling, layouts) -> None:
    requests = _requests(0, 8, 2)
    runs = [_run(tiny, sampling, *layout, requests) for layout in layouts]
    ref = runs[0][0]
    assert [(r.prompt_id, r.sample_index) for r in ref] == [
        (f"p{i}", g) for i in range(8) for g in range(2)
    ]
    for (results, used), layout in zip(runs[1:], layouts[1:], strict=True):
        assert len(used) >= 2 or layout[0] == 1, f"work was not spread over replicas: {used}"
        for a, b in zip(ref, results, strict=True):
            assert (a.prompt_id, a.sample_index) == (b.prompt_id, b.sample_index)
            assert a.tokens.tolist() == b.tokens.tolist(), layout
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
            assert a.finish_reason == b.finish_reason


def test_weight_update_at_a_safe_point_is_stamped_and_not_copied(tiny) -> None:
    cfg, params = tiny
    ecfg = EngineConfig(
        BatcherConfig(num_slots=2, max_len=48, prefill_batch=1, steps_per_call=3),
        SamplingConfig(temperature=0.0),
        StopConfig(eos_ids=(64,), pad_id=1),  # never sampled: every sample runs to its limit
    )
    engine = JaxEngine(cfg, params, ecfg, version=7)
    try:
        batcher = engine.replicas[0]
        new = jax.tree.map(lambda x: x * 1.5, params)
        new = jax.device_put(new, jax.devices()[0])
        engine.submit([Request("a", (5, 6, 7), num_samples=2, max_new_tokens=12)])
        first = engine.poll(timeout=0.0)
        assert first == []
        engine.update_weights(new, 8)
        results = engine.generate([Request("b", (9, 10), num_samples=1, max_new_tokens=5)])
        assert [r.prompt_id for r in results] == ["b"]
        streamed = []
        for _ in range(100):  # at most ~100 s
            streamed += engine.poll(timeout=1.0)
            if len(streamed) == 2:
                break
        assert sorted((r.prompt_id, r.sample_index) for r in streamed) == [("a", 0), ("a", 1)]
        # no copy: the replica holds the very buffers it was given
        held = jax.tree.leaves(batcher.params)
        for a, b in zip(held, jax.tree.leaves(new), strict=True):
            assert a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer()
        assert batcher.version == 8
        assert results[0].weight_versions == [(8, 0, 5)]
        for r in streamed:
            spans = r.weight_versions
            assert [v for v, _, _ in spans] in ([7, 8], [8]), spans
            assert spans[0][1] == 0 and spans[-1][2] == 12
            assert all(s1[2] == s2[1] for s1, s2 in zip(spans, spans[1:], strict=False))
    finally:
        engine.close()
