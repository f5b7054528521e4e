"""Gateway prompts to the backend seam and back: exact sampling settings (float32 temperature
given back as the decimal the trainer wrote), version stamps from spans, refusals."""

import numpy as np
import pytest

from gateway import convert as cv
from gateway import messages as m
from rollout_engine.backend import GroupResult, Sample, VersionSpan
from rollout_engine.wire import aborted_group, completion_of, group_of, sampling_of


def _prompt(**sampling) -> m.Prompt:
    params = m.SamplingParams(**{"temperature": 0.7, "max_new_tokens": 5, **sampling})
    # through the proto and back, as an engine receives it (temperature becomes float32)
    return cv.prompt_from_pb(
        cv.prompt_to_pb(m.Prompt("p", np.asarray([3, 4], np.int32), 2, params))
    )


def test_sampling_of_a_leased_prompt():
    p = _prompt(top_p=0.9, top_k=0, stop_token_ids=(7, 9), seed=5)
    assert p.sampling.temperature != 0.7  # float32 on the wire
    s = sampling_of(p)
    assert (s.n, s.max_tokens, s.temperature, s.top_p, s.top_k) == (2, 5, 0.7, 0.9, -1)
    assert (s.seed, s.stop_token_ids, s.ignore_eos) == (5, (7, 9), False)
    assert sampling_of(_prompt(top_k=20)).top_k == 20
    with pytest.raises(ValueError, match="reasoning_budget=64 per prompt is not supported"):
        sampling_of(_prompt(reasoning_budget=64))


def test_stamps_come_from_the_spans():
    crossed = Sample(
        (5, 6, 7), (-0.5, -0.25, -0.125), "stop", (VersionSpan(2, 0, 1), VersionSpan(3, 1, 3))
    )
    c = completion_of(crossed, version=9, generation_s=1.5)
    assert c.token_ids.dtype == np.int32 and c.token_ids.tolist() == [5, 6, 7]
    assert c.logprobs.dtype == np.float32 and c.logprobs.tolist() == [-0.5, -0.25, -0.125]
    assert (c.version_start, c.version_end, c.version_spans) == (2, 3, ((2, 0, 1), (3, 1, 3)))
    assert (c.finish_reason, c.generation_s) == ("stop", 1.5)
    whole = completion_of(Sample((1,), (-1.0,), "length", (VersionSpan(4, 0, 1),)), 9, 0.0)
    assert (whole.version_start, whole.version_end, whole.version_spans) == (4, 4, ())
    empty = completion_of(Sample((), (), "stop", ()), version=6, generation_s=0.0)
    assert (empty.version_start, empty.version_end) == (6, 6)


def test_group_checks_and_abort():
    p = _prompt()
    sample = Sample((1,), (-1.0,), "length", (VersionSpan(0, 0, 1),))
    group = group_of(p, GroupResult("p", (3, 4), (sample, sample)), 0, 0.1)
    assert group.sample_id == "p" and len(group.completions) == 2
    with pytest.raises(
        ValueError, match=r"expected 2 samples of it, the backend returned 1 of 'q'"
    ):
        group_of(p, GroupResult("q", (3, 4), (sample,)), 0, 0.1)
    aborted = aborted_group(p, version=4)
    assert [c.finish_reason for c in aborted.completions] == ["abort", "abort"]
    assert all(len(c.token_ids) == 0 and c.version_end == 4 for c in aborted.completions)
