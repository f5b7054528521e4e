"""Episodes of one group on the real JAX engine (tiny llama, its ChatML tokenizer), played
together: episodes that end at different turns give the records each gives alone, token for
token; an environment that raises, answers with an oversized observation, or hangs past its
step timeout in the middle of the group ends only its own episode (finish "abort", or the
observation cut to its bound), the others finish, and the engine is left with nothing queued
or in flight."""

from __future__ import annotations

import asyncio
import threading
from typing import ClassVar

import numpy as np
import pytest
from transformers import AutoTokenizer

from envs.base import Environment, EpisodeLimits, StepResult
from gateway import messages as m
from models.checkpoints.tiny import make_tiny_checkpoint
from rollout_engine.episode import chat_glue, run_episode
from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig


class Ends(Environment):
    """Answers "go on" until turn `turns`, then ends the episode with reward `turns / 10`;
    `fault` ("raise", "huge", "hang") happens at turn 2 instead of its answer."""

    name: ClassVar[str] = "ends"

    def __init__(self, turns: int, fault: str = "", release: threading.Event | None = None):
        self.turns, self.fault, self.release = turns, fault, release
        self.seen = 0

    def reset(self, task) -> str:
        self.seen = 0
        return str(task["question"])

    def step(self, turn: str) -> StepResult:
        self.seen += 1
        if self.seen == 2 and self.fault == "raise":
            raise RuntimeError("the environment broke")
        if self.seen == 2 and self.fault == "huge":
            return StepResult("x " * 500_000, None, False)
        if self.seen == 2 and self.fault == "hang":
            assert self.release is not None
            self.release.wait(60)
        if self.seen >= self.turns:
            return StepResult(None, self.turns / 10, True)
        return StepResult("go on", None, False)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("faults") / "ckpt", "llama")
    tok = AutoTokenizer.from_pretrained(path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "count"}], tokenize=False, add_generation_prompt=True
    )
    return path, tok, im_end, np.asarray(tok.encode(text, add_special_tokens=False), np.int32)


def _group(world, envs: list[Environment], limits: EpisodeLimits):
    """Play one episode per environment at once on one engine (greedy, 5 tokens a turn);
    returns the records and (queued, in flight) of the engine afterwards."""
    path, tok, im_end, prompt_ids = world
    cfg = JaxBackendConfig(model=str(path), num_slots=4, max_model_len=256, prefill_batch=2,
                           temperature=0.0, stop_token_ids=(im_end,))  # fmt: skip
    glue = chat_glue(tok, (im_end,))
    greedy = m.SamplingParams(temperature=0.0, max_new_tokens=5)

    async def scenario():
        backend = JaxBackend(cfg)
        await backend.start()
        try:
            played = await asyncio.gather(*(
                run_episode(backend.generate, m.Prompt(f"e{i}", prompt_ids, 1, greedy), env,
                            {"question": "count"},
                            lambda s: tok.encode(s, add_special_tokens=False),
                            lambda ids: tok.decode(ids, skip_special_tokens=True), glue, limits)
                for i, env in enumerate(envs)
            ))  # fmt: skip
            replica = backend.engine.replicas[0]
            return played, (replica.queued, replica.in_flight)
        finally:
            await backend.shutdown()

    return asyncio.run(scenario())


def test_episodes_ending_at_different_turns_equal_each_played_alone(world):
    played, left = _group(world, [Ends(1), Ends(3), Ends(2), Ends(4)], EpisodeLimits(4, 200))
    assert left == (0, 0)
    assert [turns for _, _, turns in played] == [1, 3, 2, 4]
    assert [r.observations for r, _, _ in played] == [0, 2, 1, 3]
    assert [reward for _, reward, _ in played] == [0.1, 0.3, 0.2, 0.4]
    for turns, (record, _, _) in zip((1, 3, 2, 4), played, strict=True):
        ((alone, _, _),), _ = _group(world, [Ends(turns)], EpisodeLimits(4, 200))
        assert record.token_ids.tolist() == alone.token_ids.tolist()
        assert record.forced_positions == alone.forced_positions
        record.validate()


def test_an_environment_that_raises_aborts_only_its_episode(world, caplog):
    played, left = _group(world, [Ends(3), Ends(3, "raise"), Ends(3)], EpisodeLimits(4, 200))
    assert left == (0, 0)
    assert [r.finish_reason for r, _, _ in played] == ["length", "abort", "length"]
    assert [turns for _, _, turns in played] == [3, 2, 3]
    assert [r.observations for r, _, _ in played] == [2, 1, 2]
    played[1][0].validate()
    assert "episode e1: the environment failed at turn 2: RuntimeError: the environment broke" in (
        caplog.text
    )


def test_an_oversized_observation_is_cut_to_its_bound(world):
    path, tok, *_ = world
    limits = EpisodeLimits(4, 200, max_observation_chars=40)
    played, left = _group(world, [Ends(3), Ends(3, "huge")], limits)
    assert left == (0, 0)
    normal, huge = played[0][0], played[1][0]
    assert (normal.turns, normal.observations) == (3, 2)
    assert (huge.turns, huge.observations) == (3, 2)
    forced = set(huge.forced_positions)
    env_text = tok.decode([t for j, t in enumerate(huge.token_ids.tolist()) if j in forced])
    assert "x " * 20 in env_text and "x " * 21 not in env_text  # 40 characters of it
    tight = EpisodeLimits(4, 60, max_observation_chars=10_000)
    played, left = _group(world, [Ends(3), Ends(3, "huge")], tight)
    assert left == (0, 0)
    assert played[1][0].finish_reason == "length" and played[1][2] == 2
    assert [r.turns for r, _, _ in played] == [2, 2] and len(played[1][0].token_ids) <= 60


def test_an_environment_that_hangs_past_its_timeout_aborts_only_its_episode(world, caplog):
    release = threading.Event()
    limits = EpisodeLimits(4, 200, step_timeout_s=1.0)
    try:
        played, left = _group(world, [Ends(3), Ends(3, "hang", release), Ends(2)], limits)
    finally:
        release.set()  # the abandoned step's thread ends
    assert left == (0, 0)
    assert [r.finish_reason for r, _, _ in played] == ["length", "abort", "length"]
    assert [turns for _, _, turns in played] == [3, 2, 2]
    assert "episode e1: the environment failed at turn 2: TimeoutError: no answer in 1.0 s" in (
        caplog.text
    )
