"""Per-request sampling in the JAX engine: temperature, top-k and top-p are values per slot, so one
compiled engine serves a greedy request and a T=1 request in the same batch, each drawn exactly
(token for token, log-prob for log-prob) as an engine compiled for that setting alone draws it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import RowSampling, SamplingConfig, sample, sample_rows
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

EOS = 0


@pytest.fixture(scope="module")
def tiny(tiny_split):
    return tiny_split("llama")


def _run(tiny, sampling: SamplingConfig, requests: list[Request]) -> dict:
    cfg, graphdef, params = tiny
    bcfg = BatcherConfig(num_slots=8, max_len=64, prefill_batch=4, steps_per_call=4, seed=7)
    b = ContinuousBatcher(
        cfg, graphdef, params, bcfg, sampling, StopConfig(eos_ids=(EOS,), pad_id=1)
    )
    b.submit(requests)
    out = {(r.prompt_id, r.sample_index): r for r in b.run_until_idle()}
    assert len(out) == sum(r.num_samples for r in requests)
    return out


PROMPT_A = (5, 9, 12, 3, 44, 17)
PROMPT_B = (8, 8, 21, 30, 2)


@pytest.mark.parametrize("filters", [{}, {"top_k": 12, "top_p": 0.9}])
def test_greedy_and_sampled_requests_share_one_batch(tiny, filters) -> None:
    mixed = _run(
        tiny,
        SamplingConfig(temperature=1.0, **filters),
        [
            Request("greedy", PROMPT_A, num_samples=2, max_new_tokens=20, seed=1,
                    temperature=0.0),
            Request("hot", PROMPT_B, num_samples=3, max_new_tokens=20, seed=2, temperature=1.0),
        ],
    )  # fmt: skip
    greedy_only = _run(
        tiny,
        SamplingConfig(temperature=0.0, **filters),
        [Request("greedy", PROMPT_A, num_samples=2, max_new_tokens=20, seed=1)],
    )
    hot_only = _run(
        tiny,
        SamplingConfig(temperature=1.0, **filters),
        [Request("hot", PROMPT_B, num_samples=3, max_new_tokens=20, seed=2)],
    )
    for key, alone in [*greedy_only.items(), *hot_only.items()]:
        got = mixed[key]
        assert got.tokens.tolist() == alone.tokens.tolist(), key
        np.testing.assert_array_equal(got.logprobs, alone.logprobs)
        assert got.finish_reason == alone.finish_reason
    # the sampled request really samples: its three samples are not all the same completion
    assert len({tuple(mixed[("hot", g)].tokens.tolist()) for g in range(3)}) > 1
    assert mixed[("greedy", 0)].tokens.tolist() == mixed[("greedy", 1)].tokens.tolist()


def test_a_request_default_is_the_engine_setting(tiny) -> None:
    reqs = [Request("a", PROMPT_A, num_samples=2, max_new_tokens=12, seed=3)]
    explicit = [Request("a", PROMPT_A, num_samples=2, max_new_tokens=12, seed=3, temperature=0.7)]
    a = _run(tiny, SamplingConfig(temperature=0.7), reqs)
    b = _run(tiny, SamplingConfig(temperature=1.0), explicit)
    assert all(a[k].tokens.tolist() == b[k].tokens.tolist() for k in a)


def test_top_k_needs_an_engine_started_with_a_filter(tiny) -> None:
    cfg, graphdef, params = tiny
    b = ContinuousBatcher(
        cfg, graphdef, params, BatcherConfig(num_slots=2, max_len=32, prefill_batch=1),
        SamplingConfig(temperature=1.0), StopConfig(eos_ids=(EOS,), pad_id=1),
    )  # fmt: skip
    with pytest.raises(ValueError, match="started without a top-k / top-p filter"):
        b.submit([Request("k", PROMPT_A, max_new_tokens=8, top_k=5)])
    assert b.idle()
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        Request("t", PROMPT_A, temperature=-1.0)


def test_sample_rows_equals_sample_for_each_rows_setting() -> None:
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 300)).astype(np.float32) * 3)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(1), i))(jnp.arange(6))
    configs = [
        SamplingConfig(0.0), SamplingConfig(1.0), SamplingConfig(0.7, top_k=20),
        SamplingConfig(1.0, top_p=0.8), SamplingConfig(0.5, top_k=50, top_p=0.9),
        SamplingConfig(0.0, top_k=5),
    ]  # fmt: skip
    rows = RowSampling(
        jnp.array([c.temperature for c in configs], jnp.float32),
        jnp.array([c.top_k for c in configs], jnp.int32),
        jnp.array([c.top_p for c in configs], jnp.float32),
    )
    tokens, logprobs = sample_rows(logits, keys, rows, truncate=True)
    for i, c in enumerate(configs):
        alone_t, alone_lp = sample(logits, keys, c)
        assert int(tokens[i]) == int(alone_t[i]), c
        assert float(logprobs[i]) == float(alone_lp[i]), c
