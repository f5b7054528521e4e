"""Episodes of many shapes in one group, played by the engine worker's runner
(`EpisodeRunner.group`): an environment whose observations differ in length from episode to
episode and turn to turn, and whose episodes end at different turns. Every record is exact
(token ids, log-probs, the loss mask as `forced_positions`, turns, observations, reward), and
no episode waits for another: an episode's next turn is asked while another episode of its
group is still inside an earlier turn.

The backend beside the runner is a scripted one (this is the runner's unit test): sample g's
turn t is a fixed text of `WORDS[g][t]` words, so each turn's ids are known; the environment
and the tokenizer (the tiny checkpoint's ChatML one) are real.
"""

from __future__ import annotations

import asyncio
import re
from typing import ClassVar

import numpy as np
import pytest
from transformers import AutoTokenizer

from envs import registry
from envs.base import Environment, StepResult
from gateway import messages as m
from models.checkpoints.tiny import make_tiny_checkpoint
from rollout_engine.backend import completion
from rollout_engine.episode import EpisodeRunner, chat_glue

WORDS = ((12, 9, 30), (2,), (5, 40), (3, 3, 3))
"""Words of each model turn of sample g (the last turn says "done"): episode lengths of 3, 1,
2 and 3 turns, turn lengths up to 20 times apart inside the group."""


class Shapes(Environment):
    """Answers a model turn of n words with an observation of ``n % 7 + 1`` words; a turn that
    says "done" ends the episode with reward 1 / (turns played)."""

    name: ClassVar[str] = "shapes"

    def reset(self, task) -> str:
        self.turns = 0
        return str(task["question"])

    def step(self, turn: str) -> StepResult:
        self.turns += 1
        if "done" in turn:
            return StepResult(None, 1 / self.turns, True)
        n = len(turn.split())
        return StepResult(" ".join(["obs"] * (n % 7 + 1)), None, False)


def turn_text(g: int, t: int) -> str:
    """The model text of sample g's turn t."""
    n = WORDS[g][t]
    return " ".join(["word"] * (n - 1) + ["done" if t == len(WORDS[g]) - 1 else "word"])


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("shapes") / "ckpt", "llama")
    return path, AutoTokenizer.from_pretrained(path)


def test_a_group_of_many_shapes_gives_each_episode_its_exact_record(tok, monkeypatch):
    path, tokenizer = tok
    monkeypatch.setitem(registry.ENVIRONMENTS, Shapes.name, Shapes)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    asked: list[tuple[int, int]] = []  # (sample, turn) in the order the runner asked them
    last_turn_of_1 = asyncio.Event()

    async def generate(prompt: m.Prompt, stop_strings=()) -> tuple[m.Completion, ...]:
        g, t = map(int, re.fullmatch(r"p/s(\d+)/t(\d+)", prompt.sample_id).groups())
        asked.append((g, t))
        assert prompt.continues == (t > 0) and prompt.group_size == 1
        if (g, t) == (3, 2):
            last_turn_of_1.set()
        if (g, t) == (0, 1):  # sample 0's second turn is answered only once sample 3 has
            await asyncio.wait_for(last_turn_of_1.wait(), 60)  # asked its third
        ids = encode(turn_text(g, t))
        assert prompt.sampling.max_new_tokens >= len(ids)
        lps = [-0.01 * (g + 1) * (j + 1) for j in range(len(ids))]
        return (completion(ids, lps, "length", [(7, 0, len(ids))], 7),)

    first = tokenizer.apply_chat_template(
        [{"role": "user", "content": "play"}], tokenize=False, add_generation_prompt=True
    )
    sampling = m.SamplingParams(temperature=1.0, max_new_tokens=256, seed=3)
    episode = m.Episode(env="shapes", task_json='{"question": "play"}', max_turns=4,
                        max_tokens=4000, max_observation_chars=100)  # fmt: skip
    prompt = m.Prompt("p", np.asarray(encode(first), np.int32), 4, sampling, episode=episode)
    records = asyncio.run(EpisodeRunner(str(path)).group(generate, prompt))

    # sample 3 (short turns) played its third turn while sample 0 was inside its second one
    assert asked.index((3, 2)) < asked.index((0, 2))
    assert sorted(asked) == [(g, t) for g in range(4) for t in range(len(WORDS[g]))]
    glue = chat_glue(tokenizer)
    for g, record in enumerate(records):
        ids: list[int] = []
        lps: list[float] = []
        forced: list[int] = []
        for t, n in enumerate(WORDS[g]):
            turn = encode(turn_text(g, t))
            ids += turn
            lps += [-0.01 * (g + 1) * (j + 1) for j in range(len(turn))]
            if t < len(WORDS[g]) - 1:
                extra = glue.around(turn, encode(" ".join(["obs"] * (n % 7 + 1))))
                forced += range(len(ids), len(ids) + len(extra))
                ids += extra
                lps += [0.0] * len(extra)
        assert record.token_ids.tolist() == ids, g
        assert record.logprobs.tolist() == np.asarray(lps, np.float32).tolist()  # float32, exact
        assert list(record.forced_positions) == forced
        assert (record.turns, record.observations) == (len(WORDS[g]), len(WORDS[g]) - 1)
        assert record.env_reward == pytest.approx(1 / len(WORDS[g]))
        assert (record.finish_reason, record.version_start, record.version_end) == ("length", 7, 7)
        record.validate()
    lengths = [len(r.token_ids) - len(r.forced_positions) for r in records]
    assert lengths == [sum(len(encode(turn_text(g, t))) for t in range(len(w)))
                       for g, w in enumerate(WORDS)]  # fmt: skip
    assert max(lengths) >= 8 * min(lengths)  # model tokens 8x apart inside the group
