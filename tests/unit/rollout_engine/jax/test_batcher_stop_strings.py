"""Stop strings end a sample inside the JAX engine's decode: the completion cut where its text
first holds the stop (`episode.cut_at_stop`'s cut, vLLM's with ``include_stop_str_in_output``),
nothing decoded past it, the other slots' samples unchanged."""

import numpy as np
import pytest

from gateway import messages as m
from rollout_engine.episode import cut_at_stop
from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

EOS = 0
PROMPTS = [(5, 9, 17, 3), (22, 40, 7), (11, 12, 13, 14, 15)]


def decode(ids: list[int]) -> str:
    """Token t > 0 is two characters (so a stop may end inside a token); EOS is skipped."""
    return "".join(f"{chr(64 + t // 8)}{t % 8}" for t in ids if t != EOS)


@pytest.fixture(scope="module")
def tiny(tiny_split):
    return tiny_split("llama")


def _run(tiny, stops: dict[int, tuple[str, ...]], **kw):
    cfg, graphdef, params = tiny
    b = ContinuousBatcher(
        cfg, graphdef, params, BatcherConfig(num_slots=4, max_len=64, prefill_batch=4, **kw),
        SamplingConfig(temperature=0.0), StopConfig(eos_ids=(EOS,), pad_id=1), decode=decode,
    )  # fmt: skip
    reqs = [
        Request(i, p, max_new_tokens=24, stop_strings=stops.get(i, ()))
        for i, p in enumerate(PROMPTS)
    ]
    b.submit(reqs)
    return {r.prompt_id: r for r in b.run_until_idle()}, b.decode_steps


def _completion(tokens) -> m.Completion:
    n = len(tokens)
    return m.Completion(list(tokens), -np.ones(n, np.float32), "length", 0, 0, ((0, 0, n),))


@pytest.mark.parametrize("steps", [1, 8])
def test_a_stop_spanning_two_tokens_ends_the_sample_in_the_engine(tiny, steps) -> None:
    free, free_steps = _run(tiny, {}, stop_string_steps=steps)
    ids = free[0].tokens.tolist()
    assert len(ids) >= 8 and EOS not in ids[:8], ids  # the greedy sample runs long enough
    text = decode(ids[:6])
    stop = text[7:10]  # the last char of token 4, both of token 5: spans two tokens
    want = len(cut_at_stop(_completion(ids), decode, (stop,)).token_ids)
    assert want <= 5
    got, got_steps = _run(tiny, {0: (stop,)}, stop_string_steps=steps)
    r = got[0]
    assert r.tokens.tolist() == ids[:want] and r.finish_reason == "stop"
    np.testing.assert_allclose(r.logprobs, free[0].logprobs[:want], atol=1e-6)
    assert stop in decode(r.tokens.tolist()) and stop not in decode(r.tokens[:-1].tolist())
    for i in (1, 2):  # the other slots' samples are those of the run without stops
        assert got[i].tokens.tolist() == free[i].tokens.tolist()
        assert got[i].finish_reason == free[i].finish_reason
    if steps == 1:  # the batch decodes no step for sample 0 past its stop
        longest_other = max(len(free[i].tokens) for i in (1, 2))
        assert got_steps == free_steps - max(0, len(ids) - max(want, longest_other))


def test_a_stop_that_never_appears_and_many_stops(tiny) -> None:
    free, _ = _run(tiny, {})
    got, _ = _run(tiny, {0: ("never",) * 16, 1: tuple(f"~{i}" for i in range(16))})
    for i in range(3):
        assert got[i].tokens.tolist() == free[i].tokens.tolist()


def test_bad_stop_strings_are_refused_before_anything_runs(tiny) -> None:
    with pytest.raises(ValueError, match="more than the limit 16"):
        Request(0, (1, 2), stop_strings=("a",) * 17)
    with pytest.raises(ValueError, match="non-empty"):
        Request(0, (1, 2), stop_strings=("",))
    with pytest.raises(ValueError, match="more than the limit 256"):
        Request(0, (1, 2), stop_strings=("x" * 257,))
    cfg, graphdef, params = tiny
    b = ContinuousBatcher(
        cfg, graphdef, params, BatcherConfig(num_slots=2, max_len=64),
        SamplingConfig(temperature=0.0), StopConfig(eos_ids=(EOS,), pad_id=1),
    )  # fmt: skip
    with pytest.raises(ValueError, match="no decode function"):
        b.submit([Request(0, (1, 2), stop_strings=("a",))])
    assert b.idle()
    with pytest.raises(ValueError, match="stop_string_steps must be >= 1"):
        BatcherConfig(stop_string_steps=0)
