"""Gateway prompts at the backend seam and the record backends return: exact sampling settings
after the wire (temperature 0.7 arrives as 0.7, top_k 0 stays the one "off"), version stamps
from spans, refusals."""

import numpy as np
import pytest

from gateway import convert as cv
from gateway import messages as m
from rollout_engine.backend import aborted_group, check_prompt, completion, group_of


def _prompt(**sampling) -> m.Prompt:
    params = m.SamplingParams(**{"temperature": 0.7, "max_new_tokens": 5, **sampling})
    # through the proto and back, as an engine receives it
    return cv.prompt_from_pb(
        cv.prompt_to_pb(m.Prompt("p", np.asarray([3, 4], np.int32), 2, params))
    )


def test_a_leased_prompt_keeps_its_sampling_exactly():
    p = _prompt(top_p=0.9, top_k=0, stop_token_ids=(7, 9), seed=5, ignore_eos=True)
    s = p.sampling
    assert (p.group_size, s.max_new_tokens, s.temperature, s.top_p, s.top_k) == (2, 5, 0.7, 0.9, 0)
    assert (s.seed, s.stop_token_ids, s.ignore_eos) == (5, (7, 9), True)
    assert _prompt(top_k=20).sampling.top_k == 20 and _prompt().sampling.ignore_eos is False
    check_prompt(p)
    with pytest.raises(ValueError, match="reasoning_budget=64 per prompt is not supported"):
        check_prompt(_prompt(reasoning_budget=64))
    with pytest.raises(ValueError, match="'e' is empty"):
        check_prompt(m.Prompt("e", np.zeros(0, np.int32), 2))


def test_stamps_come_from_the_spans():
    c = completion([5, 6, 7], [-0.5, -0.25, -0.125], "stop", [(2, 0, 1), (3, 1, 3)], version=9)
    assert c.token_ids.dtype == np.int32 and c.token_ids.tolist() == [5, 6, 7]
    assert c.logprobs.dtype == np.float32 and c.logprobs.tolist() == [-0.5, -0.25, -0.125]
    assert (c.version_start, c.version_end, c.version_spans) == (2, 3, ((2, 0, 1), (3, 1, 3)))
    assert c.token_versions().tolist() == [2, 3, 3] and c.token_versions().dtype == np.int32
    assert c.finish_reason == "stop"
    whole = completion([1], [-1.0], "length", [(4, 0, 1)], 9)
    assert (whole.version_start, whole.version_end, whole.version_spans) == (4, 4, ((4, 0, 1),))
    empty = completion([], [], "stop", [], version=6)
    assert (empty.version_start, empty.version_end, len(empty.token_ids)) == (6, 6, 0)
    # the record survives the wire as it is
    back = cv.completion_from_pb(cv.completion_to_pb(c))
    assert back.token_ids.dtype == np.int32 and back.token_ids.tolist() == [5, 6, 7]
    assert back.logprobs.dtype == np.float32 and back.logprobs.tolist() == [-0.5, -0.25, -0.125]
    assert back.version_spans == c.version_spans


def test_group_checks_and_abort():
    p = _prompt()
    one = completion([1], [-1.0], "length", [(0, 0, 1)], 0)
    group = group_of(p, (one, one), 0.1)
    assert group.sample_id == "p" and len(group.completions) == 2
    assert [c.generation_s for c in group.completions] == [0.1, 0.1]
    with pytest.raises(ValueError, match=r"expected 2 samples of it, the backend returned 1"):
        group_of(p, (one,), 0.1)
    aborted = aborted_group(p, version=4)
    assert [c.finish_reason for c in aborted.completions] == ["abort", "abort"]
    assert all(len(c.token_ids) == 0 and c.version_end == 4 for c in aborted.completions)
