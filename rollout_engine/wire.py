"""Between the gateway's messages and the backend seam: a leased `Prompt` becomes a
`SamplingConfig`, a backend's `GroupResult` becomes a `RolloutGroup` with its version stamps."""

from __future__ import annotations

import numpy as np

from gateway import messages as m
from rollout_engine.backend import GroupResult, Sample, SamplingConfig


def sampling_of(prompt: m.Prompt) -> SamplingConfig:
    """The backend's sampling settings for a leased prompt.

    The gateway's `top_k = 0` (no cut) becomes the seam's -1. Temperature and top-p cross the
    wire as float32 (0.7 arrives as 0.699999988...); they are given back as the shortest
    decimal that float32 rounds to (0.7), the value the trainer wrote. A reasoning budget is
    not part of the seam (the JAX engine sets it per engine), so a prompt asking for one is
    refused.

    Raises:
        ValueError: a reasoning budget, or settings the seam refuses (n, max_tokens < 1).
    """
    s = prompt.sampling
    if s.reasoning_budget:
        raise ValueError(
            f"prompt {prompt.sample_id!r}: reasoning_budget={s.reasoning_budget} per prompt is "
            "not supported by the backend seam; expected 0 (set it in the engine config)"
        )
    return SamplingConfig(
        n=prompt.group_size,
        max_tokens=s.max_new_tokens,
        temperature=_decimal(s.temperature),
        top_p=_decimal(s.top_p),
        top_k=s.top_k if s.top_k > 0 else -1,
        seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids),
    )


def _decimal(x: float) -> float:
    """The shortest decimal whose float32 is `x`'s float32: 0.699999988 -> 0.7."""
    return float(str(np.float32(x)))


def completion_of(sample: Sample, version: int, generation_s: float) -> m.Completion:
    """A gateway `Completion` of one backend sample.

    Args:
        sample: tokens `[L]`, log-probs `[L]`, finish reason and version spans.
        version: the version the backend served when the request started; the stamps when
            the sample carries no spans (L = 0).
        generation_s: seconds from the engine taking the prompt to the group's end.

    The stamps are the first and last span's versions; the spans travel too when there is
    more than one (a weight update happened while this sample was generated).
    """
    spans = sample.versions
    v0, v1 = (spans[0].version, spans[-1].version) if spans else (version, version)
    return m.Completion(
        token_ids=np.asarray(sample.token_ids, dtype=np.int32),
        logprobs=np.asarray(sample.logprobs, dtype=np.float32),
        finish_reason=sample.finish_reason,
        version_start=v0,
        version_end=v1,
        version_spans=tuple((s.version, s.start, s.end) for s in spans) if len(spans) > 1 else (),
        generation_s=generation_s,
        forced_positions=tuple(sample.forced_positions),
    )


def group_of(
    prompt: m.Prompt, result: GroupResult, version: int, generation_s: float
) -> m.RolloutGroup:
    """The `RolloutGroup` returned for `prompt` (G completions, in sample order).

    Raises:
        ValueError: the backend returned another prompt's id or not exactly G samples.
    """
    if result.prompt_id != prompt.sample_id or len(result.samples) != prompt.group_size:
        raise ValueError(
            f"prompt {prompt.sample_id!r}: expected {prompt.group_size} samples of it, the "
            f"backend returned {len(result.samples)} of {result.prompt_id!r}"
        )
    completions = tuple(completion_of(s, version, generation_s) for s in result.samples)
    return m.RolloutGroup(sample_id=prompt.sample_id, completions=completions)


def aborted_group(prompt: m.Prompt, version: int) -> m.RolloutGroup:
    """G empty completions with finish reason "abort": a prompt this engine cannot serve
    (too long, sampling it refuses). Returned, not released, so that it does not circle
    through the queue forever; the trainer drops aborted groups."""
    empty = m.Completion(
        token_ids=np.zeros(0, np.int32),
        logprobs=np.zeros(0, np.float32),
        finish_reason="abort",
        version_start=version,
        version_end=version,
    )
    return m.RolloutGroup(sample_id=prompt.sample_id, completions=(empty,) * prompt.group_size)
