"""The bounded decode attention: a decode call whose bound a slot would pass
stops at the bound (and the next call's bound holds it), and the data-parallel (sharded) mode
and several replicas with small bounds give the samples of the unbounded single replica."""

import jax.numpy as jnp
import numpy as np
import pytest

from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.engine import EngineConfig, JaxEngine
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

NEVER = StopConfig(eos_ids=(64,), pad_id=1)  # outside the vocabulary: samples run to length


@pytest.fixture(scope="module")
def tiny(tiny_split):
    return tiny_split("qwen2")


def test_a_call_stops_at_its_bound_and_the_next_bound_holds_the_slot(tiny) -> None:
    """A slot at position 10 run with bound 16 and room for 100 steps: the loop ends after 6
    steps (position 16, the first it may not attend with), and the batcher's next bound (bucket
    16, 8 steps a call) is 32; decoding on completes the sample."""
    cfg, graphdef, params = tiny
    bcfg = BatcherConfig(num_slots=2, max_len=128, prefill_batch=1, steps_per_call=8, kv_bucket=16)
    b = ContinuousBatcher(cfg, graphdef, params, bcfg, SamplingConfig(temperature=1.0), NEVER)
    b.submit([Request("p", tuple(range(1, 11)), 1, max_new_tokens=40)])
    b._fill()
    assert np.asarray(b.state.pos).tolist()[0] == 10
    assert b.kv_len() == 32  # 10 + 8 steps > 16
    b.state, steps = b._loop(b.params, b.state, jnp.int32(100), kv_len=16)
    assert int(steps) == 6 and np.asarray(b.state.pos).tolist()[0] == 16
    assert b.kv_len() == 32  # 16 + 8 <= 32
    (res,) = b.run_until_idle()
    assert len(res.tokens) == 40 and res.finish_reason == "length"


def _requests(n: int, g: int) -> list[Request]:
    rng = np.random.default_rng(7)
    return [
        Request(
            f"p{i}",
            tuple(int(t) for t in rng.integers(1, 64, size=int(rng.integers(2, 30)))),
            num_samples=g,
            max_new_tokens=int(rng.integers(20, 60)),
        )
        for i in range(n)
    ]


def _run(tiny, kv_bucket, replicas, devices_per_replica, slots, requests):
    cfg, _, params = tiny
    ecfg = EngineConfig(
        BatcherConfig(
            num_slots=slots, max_len=96, prefill_batch=2, steps_per_call=8, kv_bucket=kv_bucket
        ),  # fmt: skip
        SamplingConfig(temperature=1.0),
        NEVER,
        replicas=replicas,
        devices_per_replica=devices_per_replica,
    )
    bounds: set[int | None] = set()
    with JaxEngine(cfg, params, ecfg) as engine:
        for b in engine.replicas:  # record each decode call's bound
            b.kv_len = lambda f=b.kv_len: bounds.add(f()) or f()  # type: ignore[method-assign]
        results = engine.generate(requests)
    return results, bounds


def test_sharded_and_replicated_modes_with_bounds_give_the_unbounded_samples(tiny) -> None:
    requests = _requests(6, 2)
    ref, bounds = _run(tiny, 0, 1, 1, 4, requests)
    assert bounds == {None}
    for layout in [(1, 4, 4), (2, 1, 2)]:
        got, bounds = _run(tiny, 8, *layout, requests)
        assert {32, 64} <= bounds, (layout, bounds)  # bounded calls ran, then all slots
        for a, b in zip(ref, got, strict=True):
            assert (a.prompt_id, a.sample_index) == (b.prompt_id, b.sample_index)
            assert a.tokens.tolist() == b.tokens.tolist(), layout
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
