"""The trainer's side of multi-turn rollouts: a problem becomes the environment's first message
and an `Episode` on its prompt; an episode is scored on its last model turn (never on the
numbers a tool answered) or by its environment's own reward; the per-step episode metrics
count turns and tool calls."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from envs.calculator import INSTRUCTIONS
from gateway import messages as m
from trainer.config import Config
from trainer.data.problem import Problem
from trainer.episodes import EpisodeSetup, episode_metrics
from trainer.rewards import ScoringPool
from trainer.rewards.base import final_turn
from trainer.rollout_source import prompt_of
from trainer.rollouts import RolloutGroup

GSM = Problem("gsm8k/train/0", "Tom has 3 boxes of 14 apples. How many?", "42", "math")


def _chars(text: str) -> list[int]:
    return [ord(ch) for ch in text]


def _decode(ids) -> str:
    return "".join(chr(i) for i in ids)


def _episode(*parts: tuple[str, str], env_reward: float | None = None) -> m.Completion:
    """An episode record from ("model" | "env", text) parts, one token per character: the
    environment's characters are forced (log-prob 0), the model's sampled."""
    ids: list[int] = []
    forced: list[int] = []
    turns = observations = 0
    for who, text in parts:
        if who == "env":
            forced += range(len(ids), len(ids) + len(text))
            observations += 1
        else:
            turns += 1
        ids += _chars(text)
    lps = np.where(np.isin(np.arange(len(ids)), forced), 0.0, -0.5)
    return m.Completion(ids, lps, "stop", 0, 0, forced_positions=tuple(forced), turns=turns,
                        observations=observations, env_reward=env_reward)  # fmt: skip


def test_a_problem_becomes_the_first_message_and_an_episode():
    setup = EpisodeSetup("calculator", 3, 200, 64)
    assert setup.first_message(GSM) == f"{GSM.question}\n\n{INSTRUCTIONS}"
    episode = setup.episode_of(GSM)
    assert (episode.env, episode.max_turns, episode.max_tokens) == ("calculator", 3, 200)
    assert episode.max_observation_chars == 64
    assert json.loads(episode.task_json) == {"question": GSM.question, "answer": "42"}
    sampling = m.SamplingParams(max_new_tokens=16)
    prompt = prompt_of("0:x", GSM, lambda p: _chars(p.question), 4, sampling, setup,
                       min_version=2)  # fmt: skip
    assert _decode(prompt.token_ids) == setup.first_message(GSM)
    assert (prompt.group_size, prompt.min_version, prompt.episode) == (4, 2, episode)
    single = prompt_of("0:x", GSM, lambda p: _chars(p.question), 4, sampling, is_eval=True)
    assert _decode(single.token_ids) == GSM.question and single.episode is None
    assert single.is_eval


def test_a_task_the_environment_refuses_is_an_error_before_submission():
    with pytest.raises(ValueError, match="non-empty 'question'"):
        EpisodeSetup("calculator", 3, 200, 64).first_message(Problem("p", "", "1", "math"))
    with pytest.raises(ValueError, match="countdown needs a task"):
        EpisodeSetup("countdown", 3, 200, 64).first_message(GSM)
    with pytest.raises(ValueError, match="metadata is not JSON"):
        EpisodeSetup("calculator", 3, 200, 64).episode_of(
            Problem("p", "q", "1", "math", metadata={"x": object()})
        )


def test_config_names_a_known_environment_and_sizes_the_episode():
    cfg = Config.model_validate({"rollout": {"env": "calculator", "max_new_tokens": 64}})
    assert cfg.rollout.episodes() == EpisodeSetup("calculator", 4, 256, 1024)
    cfg = Config.model_validate(
        {"rollout": {"env": "countdown", "max_turns": 2, "episode_tokens": 100}}
    )
    assert cfg.rollout.episodes() == EpisodeSetup("countdown", 2, 100, 1024)
    assert Config().rollout.episodes() is None
    with pytest.raises(ValidationError, match="expected one of \\['calculator', 'countdown'\\]"):
        Config.model_validate({"rollout": {"env": "shell"}})


def test_an_episode_is_scored_on_its_last_turn_not_on_a_tool_result():
    right = _episode(("model", "<calc>3*14</calc>"), ("env", "<result>42</result>"),
                     ("model", "#### 42"))  # fmt: skip
    wrong = _episode(("model", "<calc>3*14</calc>"), ("env", "<result>42</result>"),
                     ("model", "#### 41"))  # fmt: skip
    assert _decode(final_turn(right)) == "#### 42"
    with ScoringPool(decode=_decode) as pool:
        group = pool.score_group(RolloutGroup("0:x", [1], (right, wrong)), GSM)
    assert group.rewards == [1.0, 0.0]  # the 42 of the tool result does not count


def test_an_environment_reward_is_the_reward():
    played = _episode(("model", "guess 5"), ("env", "too low"), ("model", "#### 42"),
                      env_reward=0.25)  # fmt: skip
    with ScoringPool(decode=_decode) as pool:
        group = pool.score_group(RolloutGroup("0:x", [1], (played,)), GSM)
    assert group.rewards == [0.25]  # its own checker's, though the answer matches the gold one


def test_episode_metrics_count_turns_and_tool_calls():
    two_calls = _episode(("model", "ab"), ("env", "123"), ("model", "c"), ("env", "4"),
                         ("model", "de"))  # fmt: skip
    no_call = _episode(("model", "xyz"))
    groups = [RolloutGroup("0:x", [1], (two_calls, no_call))]
    got = episode_metrics(groups)
    assert got == {
        "turns_per_episode": 2.0,  # (3 + 1) / 2
        "tool_calls_per_episode": 1.0,  # (2 + 0) / 2
        "env_token_fraction": 4 / 12,
    }
    single = m.Completion([1, 2], [-0.1, -0.2], "stop", 0, 0)
    assert episode_metrics([RolloutGroup("1:y", [1], (single,))]) == {}
    scored = _episode(("model", "a"), env_reward=1.0)
    assert episode_metrics([RolloutGroup("2:z", [1], (scored,))])["env_reward_mean"] == 1.0
