"""reasoning-gym problems from a fixed seed, scored by their own checkers."""

import pytest

from trainer.data import reasoning_gym_problems
from trainer.data.problem import Problem
from trainer.rewards import extract_answer, make_verifier


def test_chain_sum_problems_and_rewards():
    problems = reasoning_gym_problems("chain_sum", size=3, seed=42, min_terms=2, max_terms=2)
    assert [p.problem_id for p in problems] == [
        "rg/chain_sum/42/0",
        "rg/chain_sum/42/1",
        "rg/chain_sum/42/2",
    ]
    assert [p.question for p in problems] == [
        f"State the final answer to the following arithmetic problem: {e} ="
        for e in ("4 + 3", "812 + 880", "2 + 6")
    ]
    assert [p.answer for p in problems] == ["7", "1692", "8"]
    v = make_verifier("reasoning_gym")
    first = problems[0]
    assert v.score("<answer>7</answer>", first) == 1.0
    assert v.score("4 + 3 is\n7", first) == 1.0  # last line
    assert v.score("<answer>8</answer>", first) == 0.0
    assert v.score("", first) == 0.0
    assert v.score("<answer>1692</answer>", problems[1]) == 1.0


def test_basic_arithmetic_partial_credit():
    problems = reasoning_gym_problems("basic_arithmetic", size=2, seed=1)
    assert [(p.question, p.answer) for p in problems] == [
        ("Calculate 5 - 3 - 6.", "-4"),
        ("Calculate 2 - -1.", "3"),
    ]
    v = make_verifier("reasoning_gym")
    assert v.score("<answer> -4 </answer>", problems[0]) == 1.0
    # the default checker gives len(gold) / len(answer) when the gold is inside the answer
    assert v.score("<answer>x = -4</answer>", problems[0]) == pytest.approx(2 / 6)


def test_extract_answer():
    assert extract_answer("a <answer>1</answer> b <answer> 2 </answer>") == "2"
    assert extract_answer("line one\n  final  \n\n") == "final"
    assert extract_answer("   ") is None


def test_errors():
    v = make_verifier("reasoning_gym")
    with pytest.raises(ValueError, match="must be a reasoning-gym entry"):
        v.score("1", Problem("p", "q", "1", "reasoning_gym"))
    with pytest.raises(ValueError, match="size must be >= 1"):
        reasoning_gym_problems("chain_sum", size=0, seed=0)
    with pytest.raises(KeyError, match="unknown verifier 'nope'"):
        make_verifier("nope")
