"""Slot memory: a one-sample request that `continues` an earlier sample (an episode's next
turn) is prefilled only from where the earlier sample's slot stops matching it, and samples
what a whole prefill samples (greedy tokens equal, log-probs within 1e-5 in fp32); a weight
update forgets every slot's memory; fresh samples take the slots that remember nothing first;
requests that do not continue, or ask for several samples, are prefilled whole."""

import numpy as np
import pytest

from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

EOS = 0
FIRST = (5, 9, 30, 41, 7, 7, 12)
OBS = (3, 4, 50, 51, 52)


@pytest.fixture(scope="module")
def tiny(tiny_split):
    return tiny_split("llama")


def _batcher(tiny, slots=4, temperature=0.0):
    cfg, graphdef, params = tiny
    bcfg = BatcherConfig(num_slots=slots, max_len=128, prefill_batch=2, steps_per_call=8)
    sampling = SamplingConfig(temperature=temperature)
    return ContinuousBatcher(
        cfg, graphdef, params, bcfg, sampling, StopConfig(eos_ids=(EOS,), pad_id=1)
    )


def _one(b: ContinuousBatcher, request: Request):
    b.submit([request])
    (out,) = b.run_until_idle()
    return out


def _two_turns(b: ContinuousBatcher, continues: bool = True, samples: int = 1):
    turn1 = _one(b, Request("t1", FIRST, max_new_tokens=10))
    history = FIRST + tuple(turn1.tokens.tolist()) + OBS
    b.submit([Request("t2", history, samples, 10, seed=3, continues=continues)])
    return turn1, history, b.run_until_idle()


def test_a_continued_turn_equals_a_whole_prefill(tiny):
    b = _batcher(tiny)
    turn1, history, (turn2,) = _two_turns(b)
    assert b.continued == 1
    assert b.reused_tokens == len(FIRST) + len(turn1.tokens) - 1  # all but the uncached last
    whole = _one(_batcher(tiny), Request("t2", history, 1, 10, seed=3))
    assert turn2.tokens.tolist() == whole.tokens.tolist()
    np.testing.assert_allclose(turn2.logprobs, whole.logprobs, atol=1e-5, rtol=0)
    assert turn2.weight_versions == [(0, 0, len(turn2.tokens))]


def test_sampled_continuations_equal_whole_prefills_at_temperature_one(tiny):
    b = _batcher(tiny, temperature=1.0)
    _, history, (turn2,) = _two_turns(b)
    whole = _one(_batcher(tiny, temperature=1.0), Request("t2", history, 1, 10, seed=3))
    assert b.continued == 1
    assert turn2.tokens.tolist() == whole.tokens.tolist()  # same key, same distribution
    np.testing.assert_allclose(turn2.logprobs, whole.logprobs, atol=1e-5, rtol=0)


def test_a_partly_matching_memory_continues_from_the_common_prefix(tiny):
    """The history diverges inside the earlier completion (a turn cut at a stop string): the
    slot continues from the common prefix; the stale positions past it are overwritten."""
    b = _batcher(tiny)
    turn1 = _one(b, Request("t1", FIRST, max_new_tokens=10))
    kept = tuple(turn1.tokens.tolist()[:4])
    history = FIRST + kept + OBS
    b.submit([Request("t2", history, 1, 10, seed=3, continues=True)])
    (turn2,) = b.run_until_idle()
    assert (b.continued, b.reused_tokens) == (1, len(FIRST) + len(kept))
    whole = _one(_batcher(tiny), Request("t2", history, 1, 10, seed=3))
    assert turn2.tokens.tolist() == whole.tokens.tolist()
    np.testing.assert_allclose(turn2.logprobs, whole.logprobs, atol=1e-5, rtol=0)


def test_a_weight_update_forgets_the_memory(tiny):
    _, _, params = tiny
    b = _batcher(tiny)
    turn1 = _one(b, Request("t1", FIRST, max_new_tokens=10))
    b.update_weights(params, 1)  # the same values as a new version: still forgotten
    b.step()  # the safe point applies it
    history = FIRST + tuple(turn1.tokens.tolist()) + OBS
    out = _one(b, Request("t2", history, 1, 10, seed=3, continues=True))
    assert b.continued == 0 and out.weight_versions[0][0] == 1


def test_only_one_sample_continuations_use_the_memory(tiny):
    b = _batcher(tiny)
    _two_turns(b, continues=False)
    assert b.continued == 0
    b = _batcher(tiny)
    _, _, outs = _two_turns(b, samples=2)
    assert b.continued == 0 and len(outs) == 2


def test_fresh_samples_take_the_slots_that_remember_nothing_first(tiny):
    b = _batcher(tiny, slots=4)
    turn1 = _one(b, Request("t1", FIRST, max_new_tokens=10))
    remembered = [i for i, x in enumerate(b._memory) if x is not None]
    assert len(remembered) == 1
    b.submit([Request("other", (8, 8, 9), 3, 4)])  # three fresh samples: three free slots left
    b.run_until_idle()
    held = b._memory[remembered[0]]
    assert held is not None and held[: len(FIRST)].tolist() == list(FIRST)
    history = FIRST + tuple(turn1.tokens.tolist()) + OBS
    _one(b, Request("t2", history, 1, 10, seed=3, continues=True))
    assert b.continued == 1


def test_a_continued_turn_reads_only_the_slots_its_history_fills(tiny):
    """With a small `kv_bucket` each extension call reads and attends to only its rows'
    first kv_len slots (the bucket past the history), and three turns sample what the same
    episode samples over every slot: greedy tokens equal, log-probs within 1e-5 (fp32)."""
    cfg, graphdef, params = tiny
    runs = []
    for kv_bucket in (8, 0):
        bcfg = BatcherConfig(num_slots=2, max_len=128, prefill_batch=2, steps_per_call=8,
                             kv_bucket=kv_bucket)  # fmt: skip
        b = ContinuousBatcher(cfg, graphdef, params, bcfg, SamplingConfig(temperature=0.0),
                              StopConfig(eos_ids=(EOS,), pad_id=1))  # fmt: skip
        history, turns = FIRST, []
        for t in range(3):
            out = _one(b, Request(f"t{t}", history, 1, 12, seed=t, continues=t > 0))
            turns.append(out)
            history = history + tuple(out.tokens.tolist()) + OBS
        assert b.continued == 2
        runs.append((b.extender.buckets, turns))
    (bounded, turns8), (whole, turns0) = runs
    assert [kv for _, _, kv in bounded] == [32, 64]  # histories of at most 24 and 41 tokens
    assert {kv for _, _, kv in whole} == {128}
    for x, y in zip(turns8, turns0, strict=True):
        assert x.tokens.tolist() == y.tokens.tolist()
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="kv_bucket must be >= 0"):
        type(b.extender)(graphdef, cfg, pad_id=1, kv_bucket=-1)
