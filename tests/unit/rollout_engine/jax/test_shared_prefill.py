"""Requests of one prompt queued together (the G episodes of a group at their first turn)
share one prefill row: one row prefilled instead of G, and each request's samples are those
it gets when prefilled on its own (same seeds, tokens exact, log-probs within 1e-6)."""

import numpy as np
import pytest

from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

PROMPT = (5, 9, 17, 3, 22)
OTHER = (40, 7, 11)


@pytest.fixture(scope="module")
def tiny(tiny_split):
    return tiny_split("llama")


def _batcher(tiny) -> ContinuousBatcher:
    cfg, graphdef, params = tiny
    return ContinuousBatcher(
        cfg, graphdef, params, BatcherConfig(num_slots=4, max_len=32, prefill_batch=4),
        SamplingConfig(temperature=1.0), StopConfig(eos_ids=(0,), pad_id=1),
    )  # fmt: skip


def _requests() -> list[Request]:
    return [
        Request("a", PROMPT, 1, 8, seed=11),
        Request("b", OTHER, 1, 8, seed=12),
        Request("c", PROMPT, 1, 8, seed=13),
        Request("d", PROMPT, 1, 8, seed=14),
    ]


def test_requests_of_one_prompt_share_one_prefill_row(tiny) -> None:
    together = _batcher(tiny)
    together.submit(_requests())
    got = {r.prompt_id: r for r in together.run_until_idle()}
    assert together.prefilled_rows == 2  # PROMPT once, OTHER once
    for request in _requests():
        alone = _batcher(tiny)
        alone.submit([request])
        (want,) = alone.run_until_idle()
        assert alone.prefilled_rows == 1
        r = got[request.prompt_id]
        assert r.tokens.tolist() == want.tokens.tolist(), request.prompt_id
        np.testing.assert_allclose(r.logprobs, want.logprobs, rtol=0, atol=1e-6)
    assert len({tuple(got[k].tokens.tolist()) for k in "acd"}) == 3  # own seeds, own samples
