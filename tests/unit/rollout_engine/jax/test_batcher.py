"""Continuous batching: every (prompt, sample) comes back exactly once, across carried-over
in-flight batches, with prefill compiled once per bucket and greedy results independent of slots."""

import jax
import numpy as np
import pytest

from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

EOS = 0


@pytest.fixture(scope="module")
def tiny(tiny_split):
    return tiny_split("llama")


def _requests(rng, ids, g):
    return [
        Request(
            i,
            tuple(int(t) for t in rng.integers(1, 64, size=int(rng.integers(2, 30)))),
            num_samples=g,
            max_new_tokens=int(rng.integers(1, 24)),
        )
        for i in ids
    ]


def _batcher(tiny, slots, sampling, **kw):
    cfg, graphdef, params = tiny
    bcfg = BatcherConfig(num_slots=slots, max_len=64, prefill_batch=3, **kw)
    return ContinuousBatcher(
        cfg, graphdef, params, bcfg, sampling, StopConfig(eos_ids=(EOS,), pad_id=1)
    )


def test_every_sample_returned_exactly_once_across_carried_over_batches(tiny) -> None:
    rng = np.random.default_rng(0)
    first, second = _requests(rng, range(5), 3), _requests(rng, range(5, 9), 3)
    b = _batcher(tiny, 4, SamplingConfig(temperature=1.0), steps_per_call=5)
    b.submit(first)
    results = []
    for _ in range(4):  # leave samples of the first batch in flight and queued
        results += b.step()
    assert b.in_flight > 0
    b.submit(second)  # the next prompt batch joins the in-flight one
    results += b.run_until_idle()
    pairs = [(r.prompt_id, r.sample_index) for r in results]
    assert sorted(pairs) == [(i, g) for i in range(9) for g in range(3)]
    limits = {r.prompt_id: r.max_new_tokens for r in first + second}
    for r in results:
        n = len(r.tokens)
        assert 1 <= n <= limits[r.prompt_id]
        assert EOS not in r.tokens[:-1].tolist()
        if r.finish_reason == "stop":
            assert r.tokens[-1] == EOS
        else:  # the limit keeps the token sampled there (no forced EOS)
            assert (r.finish_reason, n) == ("length", limits[r.prompt_id])
            assert r.tokens[-1] != EOS
        assert np.all(r.logprobs < 0.0)  # every token was sampled, the last one included
        assert r.forced_positions == ()
        assert r.weight_versions == [(0, 0, n)]
    # prompts of up to 29 tokens: buckets 16, 24 and 32; prompt batches of at most 3 -> P 4
    assert {t for _, t in b.prefiller.buckets} <= {16, 24, 32}
    assert len(b.prefiller.buckets) == len(set(b.prefiller.buckets))


def test_greedy_samples_do_not_depend_on_the_number_of_slots(tiny) -> None:
    rng = np.random.default_rng(1)
    reqs = _requests(rng, range(4), 2)
    greedy = SamplingConfig(temperature=0.0)
    outs = []
    for slots in (1, 3, 8):
        b = _batcher(tiny, slots, greedy)
        b.submit(reqs)
        res = sorted(b.run_until_idle(), key=lambda r: (r.prompt_id, r.sample_index))
        outs.append([r.tokens.tolist() for r in res])
    assert outs[0] == outs[1] == outs[2]
    for i in range(0, 8, 2):  # the two greedy samples of a prompt agree
        assert outs[0][i] == outs[0][i + 1]


def test_sampled_tokens_depend_only_on_the_request_seed(tiny) -> None:
    rng = np.random.default_rng(2)
    reqs = _requests(rng, range(3), 2)
    outs = []
    for slots in (2, 5):
        b = _batcher(tiny, slots, SamplingConfig(temperature=1.0))
        b.submit(reqs)
        res = sorted(b.run_until_idle(), key=lambda r: (r.prompt_id, r.sample_index))
        outs.append([(r.tokens.tolist(), r.logprobs.round(5).tolist()) for r in res])
    assert outs[0] == outs[1]


def test_too_long_request_is_refused(tiny) -> None:
    b = _batcher(tiny, 2, SamplingConfig())
    with pytest.raises(ValueError, match="needs 70 positions"):
        b.submit([Request("x", tuple(range(1, 41)), max_new_tokens=31)])
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        Request("y", (1, 2), num_samples=0)


def test_weight_switch_between_decode_loops_is_stamped_per_token(tiny) -> None:
    cfg, graphdef, params = tiny
    bcfg = BatcherConfig(num_slots=2, max_len=64, prefill_batch=1, steps_per_call=3)
    never = StopConfig(eos_ids=(64,), pad_id=1)  # id 64 is outside the vocabulary
    greedy = SamplingConfig(temperature=0.0)
    req = Request("a", (5, 6, 7), num_samples=1, max_new_tokens=12)

    old_only = ContinuousBatcher(cfg, graphdef, params, bcfg, greedy, never, version=7)
    old_only.submit([req])
    reference = old_only.run_until_idle()[0]

    b = ContinuousBatcher(cfg, graphdef, params, bcfg, greedy, never, version=7)
    b.submit([req])
    assert b.step() == []  # first token from the prefill, then 3 decode steps: 4 tokens
    new = jax.tree.map(lambda x: x * 1.5, params)
    b.update_weights(new, 8)
    b.submit([Request("b", (9, 10), num_samples=1, max_new_tokens=5)])
    results = {r.prompt_id: r for r in b.run_until_idle()}
    a = results["a"]
    assert a.weight_versions == [(7, 0, 4), (8, 4, 12)]
    assert a.versions == (7, 8)
    # the first 4 tokens came from the old weights, the next 7 from the new ones
    np.testing.assert_array_equal(a.logprobs[:4], reference.logprobs[:4])
    assert np.all(np.abs(a.logprobs[4:11] - reference.logprobs[4:11]) > 1e-4)
    assert results["b"].weight_versions == [(8, 0, 5)]


def test_reasoning_budget_inserts_the_phrase_in_the_engine(tiny) -> None:
    phrase = (60, 61, 62)
    stops = StopConfig(eos_ids=(64,), pad_id=1, think_phrase=phrase, think_budget=6)
    bcfg = BatcherConfig(num_slots=3, max_len=64, prefill_batch=3)
    b = ContinuousBatcher(*tiny, bcfg, SamplingConfig(temperature=1.0), stops)
    b.submit([Request(i, (3, 4, 5 + i), num_samples=2, max_new_tokens=10) for i in range(3)])
    results = b.run_until_idle()
    assert len(results) == 6
    inserted = 0
    for r in results:
        toks = r.tokens.tolist()
        if 62 in toks[:3]:  # ended its thinking by itself: left alone, nothing forced
            assert r.forced_positions == ()
            continue
        inserted += 1
        assert toks[3:6] == list(phrase)
        np.testing.assert_array_equal(r.logprobs[3:6], np.zeros(3, np.float32))
        # exactly the phrase is reported forced (the trainer masks it out of the loss)
        assert r.forced_positions == (3, 4, 5)
        if r.finish_reason == "length":
            assert len(toks) == 10 and r.logprobs[9] < 0.0  # sampled at the limit
    assert inserted > 0


def test_bounded_decode_attention_gives_the_unbounded_samples(tiny) -> None:
    """With kv_bucket 16 and max_len 256 the decode calls attend to 16, 32, 64 and 128 slots,
    then all, as the samples grow; tokens and log-probs equal those of kv_bucket 0 (every call
    attends to all 256 slots): the slots past a position are masked, so the bound only skips
    work."""
    cfg, graphdef, params = tiny
    rng = np.random.default_rng(5)
    reqs = [
        Request(i, tuple(int(t) for t in rng.integers(1, 64, size=n)), 2, max_new_tokens=200)
        for i, n in enumerate((3, 5, 29))
    ]
    never = StopConfig(eos_ids=(64,), pad_id=1)  # outside the vocabulary: samples run to 200
    outs, bounds = [], []
    for bucket in (0, 16):
        bcfg = BatcherConfig(num_slots=4, max_len=256, prefill_batch=2, steps_per_call=8,
                             kv_bucket=bucket)  # fmt: skip
        b = ContinuousBatcher(cfg, graphdef, params, bcfg, SamplingConfig(temperature=1.0), never)
        seen: list[int | None] = []
        unspied = b.kv_len
        b.kv_len = lambda seen=seen, f=unspied: seen.append(f()) or seen[-1]  # type: ignore[method-assign]
        b.submit(reqs)
        res = sorted(b.run_until_idle(), key=lambda r: (r.prompt_id, r.sample_index))
        assert [len(r.tokens) for r in res] == [200] * 6
        outs.append(res)
        bounds.append(set(seen))
    assert bounds[0] == {None}
    assert bounds[1] == {16, 32, 64, 128, None}
    for free, bounded in zip(*outs, strict=True):
        assert free.tokens.tolist() == bounded.tokens.tolist()
        np.testing.assert_allclose(bounded.logprobs, free.logprobs, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="kv_bucket must be >= 0"):
        BatcherConfig(kv_bucket=-1)


def test_decode_rows_bounded_to_the_occupied_slots_give_the_same_samples(tiny) -> None:
    """With row_bucket 2 and 8 slots, three requests of 2 samples fill slots 0-5 (the lowest
    free ones): the decode calls compute all 8 rows, then 4 once the third request's samples
    ended (slots 0-3 occupied), then 2, and a second request's two samples take slots 0 and 1
    again although they remember the first pass (bound 2); tokens and log-probs equal those of
    row_bucket 0 (every call computes all 8 rows): the rows past the bound are empty, so it
    only skips work. A negative bucket is refused."""
    cfg, graphdef, params = tiny
    rng = np.random.default_rng(6)
    reqs = [
        Request(i, tuple(int(t) for t in rng.integers(1, 64, size=n)), 2, max_new_tokens=m)
        for i, (n, m) in enumerate(((4, 120), (9, 60), (17, 20)))
    ]
    never = StopConfig(eos_ids=(64,), pad_id=1)  # outside the vocabulary: samples run to m
    outs, bounds = [], []
    for bucket in (0, 2):
        bcfg = BatcherConfig(num_slots=8, max_len=160, prefill_batch=4, steps_per_call=8,
                             row_bucket=bucket)  # fmt: skip
        b = ContinuousBatcher(cfg, graphdef, params, bcfg, SamplingConfig(temperature=1.0), never)
        seen: list[int | None] = []
        unspied = b.row_bound
        b.row_bound = lambda seen=seen, f=unspied: seen.append(f()) or seen[-1]  # type: ignore[method-assign]
        b.submit(reqs)
        res = sorted(b.run_until_idle(), key=lambda r: (r.prompt_id, r.sample_index))
        assert [len(r.tokens) for r in res] == [120, 120, 60, 60, 20, 20]
        first = list(dict.fromkeys(seen))
        seen.clear()  # a second pass: slots 0-5 remember the first pass's samples, 6-7
        # nothing; two fresh samples still take slots 0 and 1 (inside the smallest bound)
        b.submit([Request(9, (5, 6, 7), 2, max_new_tokens=30)])
        res += b.run_until_idle()
        outs.append(res)
        bounds.append((first, set(seen)))
    assert bounds == [([None], {None}), ([None, 4, 2], {2})]
    for full, bounded in zip(*outs, strict=True):
        assert full.tokens.tolist() == bounded.tokens.tolist()
        np.testing.assert_allclose(bounded.logprobs, full.logprobs, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="row_bucket must be >= 0"):
        BatcherConfig(row_bucket=-1)


def test_prompts_prefilled_at_once_are_chunked_by_length(tiny) -> None:
    """16 prompts alternating 5 and 20 tokens, 8 per prefill call: in arrival order both calls
    would pad to T = 24; shortest first, one pads to 16 and one to 24. The samples are those of
    one prompt at a time."""
    rng = np.random.default_rng(4)
    reqs = [
        Request(i, tuple(int(t) for t in rng.integers(1, 64, size=5 if i % 2 else 20)), 1, 6)
        for i in range(16)
    ]
    greedy = SamplingConfig(temperature=0.0)
    cfg, graphdef, params = tiny
    bcfg = BatcherConfig(num_slots=16, max_len=64, prefill_batch=8)
    b = ContinuousBatcher(cfg, graphdef, params, bcfg, greedy, StopConfig((EOS,), 1))
    b.submit(reqs)
    together = sorted(b.run_until_idle(), key=lambda r: r.prompt_id)
    assert b.prefiller.buckets == [(8, 16), (8, 24)]
    assert b.prefilled_rows == 16
    one = _batcher(tiny, 1, greedy)
    for r, out in zip(reqs, together, strict=True):
        one.submit([r])
        (alone,) = one.run_until_idle()
        assert out.prompt_id == r.prompt_id
        assert out.tokens.tolist() == alone.tokens.tolist()
        np.testing.assert_allclose(out.logprobs, alone.logprobs, atol=1e-5, rtol=0)
