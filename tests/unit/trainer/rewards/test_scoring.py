"""Scoring groups in the thread pool: rewards land on the right completions."""

import threading

import pytest

from gateway.messages import Completion
from trainer.data import Problem, reasoning_gym_problems
from trainer.rewards import ScoringPool, TextVerifier, TokenFractionVerifier
from trainer.rollouts import RolloutGroup


def _group(texts, sample_id="g"):
    comps = [Completion([1], [-0.1], "stop", 0, 0, text=t) for t in texts]
    return RolloutGroup(sample_id, [0], comps)


def test_score_async_mixed_verifiers():
    rg = reasoning_gym_problems("chain_sum", size=1, seed=42, min_terms=2, max_terms=2)[0]
    math = Problem("m", "q", "#### 18", "math")
    with ScoringPool(max_workers=2) as pool:
        f1 = pool.score_async(_group(["<answer>7</answer>", "<answer>6</answer>", "7"]), rg)
        f2 = pool.score_async(_group(["\\boxed{18}", "19"]), math)
        assert f1.result(timeout=60).rewards == [1.0, 0.0, 1.0]
        assert f2.result(timeout=60).rewards == [1.0, 0.0]


def test_runs_off_the_calling_thread_and_decodes():
    seen = []

    class Recorder(TextVerifier):
        name = "recorder"

        def score(self, completion, problem):
            seen.append(threading.current_thread().name)
            return float(len(completion))

    group = RolloutGroup("g", [0], [Completion([1, 2, 3], [-0.1] * 3, "stop", 0, 0)])
    with ScoringPool(decode=lambda ids: "x" * sum(ids), verifiers={"recorder": Recorder()}) as pool:
        scored = pool.score_async(group, Problem("p", "q", "a", "recorder")).result(timeout=10)
    assert scored.rewards == [6.0]
    assert seen and all(name.startswith("scoring") for name in seen)


def test_missing_text_without_decode_raises_through_the_future():
    group = RolloutGroup("g", [0], [Completion([1], [-0.1], "stop", 0, 0)])
    with ScoringPool() as pool:
        future = pool.score_async(group, Problem("p", "q", "#### 1", "math"))
        with pytest.raises(ValueError, match="has no text and the pool has no decode"):
            future.result(timeout=10)


def test_token_fraction_needs_no_text_or_decode():
    group = RolloutGroup(
        "g",
        [0],
        [
            Completion([5, 5, 1, 2], [-0.1] * 4, "stop", 0, 0),  # 5 twice of 3 counted (2 = EOS)
            Completion([2], [-0.1], "stop", 0, 0),  # only EOS: 0
            Completion([5, 5], [-0.1] * 2, "length", 0, 0),
        ],
    )
    verifiers = {"token_fraction": TokenFractionVerifier(token_id=5, ignore_ids=[2])}
    with ScoringPool(verifiers=verifiers) as pool:
        scored = pool.score_async(group, Problem("p", "q", "", "token_fraction")).result(10)
        assert scored.rewards == [2 / 3, 0.0, 1.0]
        # a problem's own target id wins over the default
        other = Problem("p", "q", "", "token_fraction", {"token_id": 1})
        assert pool.score_group(group, other).rewards == [1 / 3, 0.0, 0.0]
    with pytest.raises(ValueError, match="no metadata\\['token_id'\\]"):
        TokenFractionVerifier().score_completion(None, [1], Problem("p", "q", "", "x"))
