"""The calculator and countdown environments played by scripted replies: the exact observations
of each turn, when an episode ends, the rewards, and hostile or malformed turns answered
without raising."""

from __future__ import annotations

import pytest
import reasoning_gym

from envs.base import EpisodeLimits, StepResult
from envs.registry import ENVIRONMENTS, make_env


def test_calculator_three_turn_episode():
    env = make_env("calculator")
    first = env.reset({"question": "Ann has 48 apples and gives away half. Then she buys 48."})
    assert first.startswith("Ann has 48 apples") and "<calc>expression</calc>" in first
    assert env.step("Half of 48: <calc>48 / 2</calc>") == StepResult(
        "<result>24</result>", None, False
    )
    assert env.step("<calc>24 + 48</calc>") == StepResult("<result>72</result>", None, False)
    assert env.step("She has 72 apples.\n#### 72") == StepResult(None, None, True)
    assert env.calls == 2
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("again")


@pytest.mark.parametrize(
    ("turn", "observation"),
    [
        ("<calc>__import__('os').system('true')</calc>", "<result>error: Call is not allowed"),
        ("<calc>2**1000</calc>", "<result>error: exponent larger than 64"),
        ("<calc>1/0</calc>", "<result>error: division by zero"),
        ("<calc>" + "9" * 10_000_000, "<result>error: expression longer than 256 characters"),
        ("cut at the limit <calc>3 * 7", "<result>21</result>"),
        ("<calc>1+1</calc> and <calc>2+2</calc>", "<result>2</result>"),
    ],
)
def test_calculator_answers_hostile_and_cut_calls(turn, observation):
    env = make_env("calculator")
    env.reset({"question": "q"})
    result = env.step(turn)
    assert result.observation is not None and result.observation.startswith(observation)
    assert not result.done and len(result.observation) < 100


def test_calculator_needs_a_question_and_a_reset():
    env = make_env("calculator")
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("<calc>1</calc>")
    with pytest.raises(ValueError, match="question"):
        env.reset({"answer": "3"})


def _countdown_entry():
    ds = reasoning_gym.create_dataset("countdown", size=1, seed=1, min_numbers=3, max_numbers=3)
    return ds[0]


def test_countdown_feedback_until_solved():
    entry = _countdown_entry()
    assert entry["metadata"]["numbers"] == [71, 33, 12] and entry["metadata"]["target"] == 116
    env = make_env("countdown")
    first = env.reset({"entry": entry})
    assert first.startswith(entry["question"]) and "<answer></answer>" in first
    wrong = env.step("Let me try <answer>71 + 33</answer>")
    assert wrong == StepResult(
        "Your expression equals 104, not 116 (or it breaks a rule). Try again.", 0.05, False
    )
    bad = env.step("<answer>71 + foo</answer>")
    assert bad.observation == (
        "Your guess could not be computed (Name is not allowed in arithmetic). The target is 116."
    )
    assert env.step("") == StepResult("No guess found. The target is 116.", 0.01, False)
    assert env.step("<answer>12 + 71 + 33</answer>") == StepResult(None, 1.0, True)
    assert env.guesses == 4


def test_countdown_refuses_other_tasks_and_unknown_names():
    with pytest.raises(ValueError, match="reasoning-gym countdown"):
        make_env("countdown").reset({"question": "2+2"})
    with pytest.raises(ValueError, match="unknown environment 'chess'; known"):
        make_env("chess")
    assert sorted(ENVIRONMENTS) == ["calculator", "countdown"]
    assert make_env("calculator").stop_strings == ("</calc>",)


def test_episode_limits_are_positive():
    assert EpisodeLimits().max_turns == 4
    with pytest.raises(ValueError, match=">= 1"):
        EpisodeLimits(max_turns=0)
