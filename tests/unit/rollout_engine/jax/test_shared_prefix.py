"""Prompts of one prefill that share a prefix prefill it once (`BatcherConfig.shared_prefix_min`):
the same logits, cache entries and samples as each prompt prefilled whole, the prefix computed
once per weight version, and the plain path wherever sharing cannot serve."""

import jax
import numpy as np
import pytest

from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.prefill import Prefiller
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

EOS = 0
TOL = 2e-5  # float32 logits and log-probs, the same math in another order


@pytest.fixture(scope="module", params=["llama", "gemma3"])  # gemma3: sliding-window layers
def tiny(request, tiny_split):
    return tiny_split(request.param)


def _prompts(n: int, shared: int, seed: int = 0) -> list[tuple[int, ...]]:
    """n prompts that share their first `shared` tokens, then 3 to 19 tokens of their own."""
    rng = np.random.default_rng(seed)
    head = tuple(int(t) for t in rng.integers(1, 64, shared))
    return [head + tuple(int(t) for t in rng.integers(1, 64, int(rng.integers(3, 20))))
            for _ in range(n)]  # fmt: skip


def _prefiller(tiny, max_len: int = 64) -> Prefiller:
    cfg, graphdef, _ = tiny
    return Prefiller(graphdef, cfg, pad_id=1, max_len=max_len, batch=4)


def test_a_prefill_behind_the_shared_prefix_equals_the_whole_prompts(tiny) -> None:
    _, _, params = tiny
    pre = _prefiller(tiny)
    prompts = _prompts(4, 21)
    whole = pre(params, prompts)
    prefix = pre.shared_prefix(params, prompts[0][:16])
    assert prefix.bucket == 16 and int(prefix.length) == 16
    behind = pre(params, [p[16:] for p in prompts], prefix)
    np.testing.assert_array_equal(np.asarray(behind.lengths), np.asarray(whole.lengths))
    np.testing.assert_allclose(
        np.asarray(behind.last_logits), np.asarray(whole.last_logits), atol=TOL, rtol=0
    )
    for got, want in zip(
        behind.cache.k + behind.cache.v, whole.cache.k + whole.cache.v, strict=True
    ):
        for row, n in enumerate(len(p) for p in prompts):  # each prompt's real positions
            np.testing.assert_allclose(
                np.asarray(got[row, :, :n]), np.asarray(want[row, :, :n]), atol=TOL, rtol=0
            )
    # the prefix's own row (P = 1), the suffixes (up to 22 tokens) and the whole prompts
    assert pre.buckets == [(1, 16), (4, 24), (4, 40)]


def test_suffixes_that_do_not_fit_behind_the_prefix_are_refused(tiny) -> None:
    _, _, params = tiny
    pre = _prefiller(tiny, max_len=48)
    prefix = pre.shared_prefix(params, list(range(1, 25)))  # bucket 24
    assert not pre.fits(24, [list(range(1, 30))])  # 24 + bucket 32 > 48
    assert pre.fits(24, [list(range(1, 20))])  # 24 + 24
    with pytest.raises(ValueError, match="exceed max_len=48"):
        pre(params, [list(range(1, 30))], prefix)


def _batcher(tiny, params=None, max_len=80, **kw) -> ContinuousBatcher:
    cfg, graphdef, p = tiny
    bcfg = BatcherConfig(num_slots=8, max_len=max_len, prefill_batch=3, steps_per_call=8, **kw)
    return ContinuousBatcher(
        cfg, graphdef, p if params is None else params, bcfg, SamplingConfig(temperature=1.0),
        StopConfig(eos_ids=(EOS,), pad_id=1),
    )  # fmt: skip


def _run(b: ContinuousBatcher, prompts, tag: str = "") -> dict:
    b.submit([Request(f"{tag}{i}", p, num_samples=2, max_new_tokens=12)
              for i, p in enumerate(prompts)])  # fmt: skip
    return {(r.prompt_id, r.sample_index): r for r in b.run_until_idle()}


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, r in want.items():
        assert got[k].tokens.tolist() == r.tokens.tolist(), k
        np.testing.assert_allclose(got[k].logprobs, r.logprobs, atol=TOL, rtol=0)


def test_samples_behind_a_shared_prefix_equal_whole_prefills(tiny) -> None:
    prompts = _prompts(7, 27)  # 3 calls of <= 3 prompts; n0 = 24 (27 down to a multiple of 8)
    shared = _batcher(tiny)
    got = _run(shared, prompts)
    _assert_same(got, _run(_batcher(tiny, shared_prefix_min=0), prompts))
    assert shared.prefixes_prefilled == 1  # computed once, used by every call
    # 2 calls of 3 prompts and the last prompt alone, which finds the cached prefix
    assert shared.shared_prefix_tokens == 24 * 7
    assert shared.prefilled_rows == 7


def test_new_weights_drop_the_cached_prefix(tiny) -> None:
    other = jax.tree.map(lambda x: x * 1.05, tiny[2])
    prompts = _prompts(6, 20, seed=1)
    b = _batcher(tiny)
    _run(b, prompts, "a")
    assert b.prefixes_prefilled == 1
    b.update_weights(other, 1)
    got = _run(b, prompts, "b")
    assert b.prefixes_prefilled == 2  # the prefix of version 0 was not reused
    _assert_same(got, _run(_batcher(tiny, params=other, shared_prefix_min=0), prompts, "b"))


@pytest.mark.parametrize(
    ("shared", "lengths_ok", "why"),
    [
        (12, True, "a shared prefix of 12 tokens rounds down to 8, below the 16 asked"),
        (30, False, "a prompt of 8 tokens: n0 <= its length - 1 = 7, below 16"),
    ],
)
def test_no_sharing_where_it_cannot_serve(tiny, shared, lengths_ok, why) -> None:
    prompts = _prompts(3, shared, seed=2)
    if not lengths_ok:
        prompts[2] = prompts[2][:8]  # all three share 8 tokens, with one left after them
    b = _batcher(tiny)
    got = _run(b, prompts)
    assert b.shared_prefix_tokens == 0 and b.prefixes_prefilled == 0, why
    _assert_same(got, _run(_batcher(tiny, shared_prefix_min=0), prompts))


def test_prompts_that_fit_only_whole_are_prefilled_whole(tiny) -> None:
    rng = np.random.default_rng(3)
    head = tuple(int(t) for t in rng.integers(1, 64, 40))
    prompts = [head + tuple(int(t) for t in rng.integers(1, 64, n)) for n in (1, 2, 3)]
    # whole: bucket 48 <= 54; behind the prefix: 40 + the smallest bucket 16 = 56 > 54
    b = _batcher(tiny, max_len=54)
    got = _run(b, prompts)
    assert b.shared_prefix_tokens == 0 and b.prefixes_prefilled == 0  # not even computed
    _assert_same(got, _run(_batcher(tiny, max_len=54, shared_prefix_min=0), prompts))


def test_a_mixture_of_experts_model_never_shares(tiny_split) -> None:
    moe = tiny_split("qwen3_moe")
    prompts = _prompts(3, 24)
    b = _batcher(moe)
    got = _run(b, prompts)
    assert b.shared_prefix_tokens == 0  # routing replay records every prompt position
    assert all(r.routes is not None for r in got.values())


def test_a_negative_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="shared_prefix_min must be >= 0"):
        BatcherConfig(shared_prefix_min=-1)
