"""Multi-turn episodes on the real JAX engine (tiny llama with its ChatML tokenizer) against a
scripted environment that answers fixed observations: the exact token ids of a 3-turn episode
(each model turn is what the engine samples from that history, then the template's ids and the
observation's), the loss mask equal to the model's tokens only, and turn 3's log-probs equal to
a fresh forward of the whole sequence within 1e-5 (fp32)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoTokenizer

from envs.base import Environment, EpisodeLimits, StepResult
from gateway import messages as m
from models.checkpoints.hf_io import load_hf_checkpoint
from models.checkpoints.tiny import make_tiny_checkpoint
from rollout_engine.episode import TurnGlue, chat_glue, cut_at_stop, derived_seed, run_episode
from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig

REPLIES = ("obs one", "the result is 42")


class Scripted(Environment):
    """Answers REPLIES in order, then ends the episode with reward 0.5."""

    name: ClassVar[str] = "scripted"

    def reset(self, task) -> str:
        self.seen: list[str] = []
        return str(task["question"])

    def step(self, turn: str) -> StepResult:
        self.seen.append(turn)
        if len(self.seen) <= len(REPLIES):
            return StepResult(REPLIES[len(self.seen) - 1], None, False)
        return StepResult(None, 0.5, True)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ep") / "ckpt", "llama")
    tok = AutoTokenizer.from_pretrained(path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    return path, tok, im_end


def _play(path, tok, im_end, sampling: m.SamplingParams, limits: EpisodeLimits, context=128):
    cfg = JaxBackendConfig(model=str(path), num_slots=2, max_model_len=context, prefill_batch=1,
                           temperature=sampling.temperature, stop_token_ids=(im_end,))  # fmt: skip
    glue = chat_glue(tok, (im_end,))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "add 40 and 2"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tok.encode(text, add_special_tokens=False)
    prompt = m.Prompt("ep0", np.asarray(prompt_ids, np.int32), 1, sampling)

    async def scenario():
        backend = JaxBackend(cfg)
        await backend.start()
        try:
            env = Scripted()
            record, reward, turns = await run_episode(
                backend.generate, prompt, env, {"question": "add 40 and 2"},
                lambda s: tok.encode(s, add_special_tokens=False),
                lambda ids: tok.decode(ids, skip_special_tokens=True), glue, limits,
            )  # fmt: skip
            replica = backend.engine.replicas[0]
            continued = (replica.continued, replica.reused_tokens)
            # the same turns asked one by one: what the engine samples from each history
            turns_alone = []
            for t, start in enumerate(_starts(record)):
                history = np.asarray(prompt_ids + record.token_ids[:start].tolist(), np.int32)
                turn = dataclasses.replace(sampling, seed=derived_seed(sampling.seed, t))
                (c,) = await backend.generate(m.Prompt(f"ep0/t{t}", history, 1, turn))
                turns_alone.append(c)
            return record, reward, turns, env.seen, turns_alone, continued
        finally:
            await backend.shutdown()

    return asyncio.run(scenario()), glue, prompt_ids


def _starts(record: m.Completion) -> list[int]:
    """Index of the first token of each model turn (after each run of forced tokens)."""
    forced = set(record.forced_positions)
    return [
        j for j in range(len(record.token_ids)) if j not in forced and (j == 0 or j - 1 in forced)
    ]


def test_three_turn_episode_token_for_token(world):
    path, tok, im_end = world
    greedy = m.SamplingParams(temperature=0.0, max_new_tokens=6)
    (record, reward, turns, seen, alone, continued), glue, _ = _play(
        path, tok, im_end, greedy, EpisodeLimits(4, 200)
    )
    assert turns == 3 and reward == 0.5 and len(seen) == 3
    assert (record.turns, record.observations, record.env_reward) == (3, 2, 0.5)
    assert all(len(c.token_ids) >= 1 for c in alone)
    assert (
        tok.decode([*glue.end_of_turn, *glue.before_observation])
        == "<|im_end|>\n<|im_start|>user\n"
    )
    assert tok.decode(list(glue.after_observation)) == "<|im_end|>\n<|im_start|>assistant\n"
    want: list[int] = []
    model_positions: list[int] = []
    for t, c in enumerate(alone):
        turn = c.token_ids.tolist()
        model_positions += range(len(want), len(want) + len(turn))
        want += turn
        if t < 2:
            want += glue.around(turn, tok.encode(REPLIES[t], add_special_tokens=False))
    assert record.token_ids.tolist() == want
    assert continued[0] == 2  # turns 2 and 3 continued in the slot of the turn before
    # the loss mask: every token but the model's is forced (log-prob 0)
    mask = np.ones(len(want), bool)
    mask[list(record.forced_positions)] = False
    assert np.flatnonzero(mask).tolist() == model_positions
    assert np.all(record.logprobs[~mask] == 0.0)
    assert seen == [tok.decode(c.token_ids.tolist(), skip_special_tokens=True) for c in alone]
    record.validate()
    assert record.version_start == record.version_end == 0


def test_turn_three_logprobs_equal_a_full_forward(world):
    path, tok, im_end = world
    hot = m.SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    (record, _, turns, _, alone, continued), _, prompt_ids = _play(
        path, tok, im_end, hot, EpisodeLimits(3, 200)
    )
    assert turns == 3
    third = _starts(record)[2]
    _, model = load_hf_checkpoint(path)
    seq = jnp.asarray([prompt_ids + record.token_ids.tolist()], jnp.int32)
    logits, _ = model(seq, jnp.arange(seq.shape[1], dtype=jnp.int32)[None])
    logp = jax.nn.log_softmax(logits[0].astype(jnp.float32), -1)
    n = len(prompt_ids)
    positions = range(third, len(record.token_ids))
    full = [float(logp[n + j - 1, record.token_ids[j]]) for j in positions]
    # turns 2 and 3 were continued in the slot of the turn before (only the new tokens were
    # prefilled), and still equal a fresh forward of the whole sequence, and the same turn
    # prefilled whole
    assert continued[0] == 2 and continued[1] >= len(prompt_ids) + third - 8, continued
    np.testing.assert_allclose(record.logprobs[third:], full, atol=1e-5, rtol=0)
    assert record.token_ids[third:].tolist() == alone[2].token_ids.tolist()
    np.testing.assert_allclose(record.logprobs[third:], alone[2].logprobs, atol=1e-5, rtol=0)


def test_budget_ends_the_episode_with_length(world):
    """A token budget too small for the first observation: one turn, finish "length"."""
    path, tok, im_end = world
    greedy = m.SamplingParams(temperature=0.0, max_new_tokens=6)
    (record, reward, turns, _, _, _), _, _ = _play(path, tok, im_end, greedy, EpisodeLimits(4, 8))
    assert turns == 1 and reward is None and record.finish_reason == "length"
    assert record.forced_positions == () and 1 <= len(record.token_ids) <= 6
    assert (record.turns, record.observations, record.env_reward) == (1, 0, None)


def test_a_history_past_the_engine_context_ends_after_the_last_model_turn(world):
    """The engine fits the prompt and turn 1 but not turn 2 after the observation: the episode
    ends after turn 1 ("length"), without the observation it could not answer; a prompt that
    does not fit at all is refused (ValueError), as a single-turn prompt is."""
    path, tok, im_end = world
    greedy = m.SamplingParams(temperature=0.0, max_new_tokens=6)
    text = tok.apply_chat_template([{"role": "user", "content": "add 40 and 2"}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    n = len(tok.encode(text, add_special_tokens=False))
    (record, _, turns, seen, alone, _), _, _ = _play(
        path, tok, im_end, greedy, EpisodeLimits(4, 200), context=n + 6 + 4
    )
    assert turns == 1 and len(seen) == 1 and record.finish_reason == "length"
    assert (record.turns, record.observations) == (1, 0)  # the unanswered one is not counted
    assert (
        record.forced_positions == () and record.token_ids.tolist() == alone[0].token_ids.tolist()
    )
    with pytest.raises(ValueError):
        _play(path, tok, im_end, greedy, EpisodeLimits(4, 200), context=n + 2)


def test_a_turn_ends_at_the_environments_stop_string():
    """`cut_at_stop`: the record a stop-string sampler would make: the tokens up to the one
    that completes ``</calc>``, their log-probs and versions unchanged, finish "stop"."""
    text = "ab<calc>1+2</calc>xyz"
    ids = [ord(ch) for ch in text]
    lps = -np.arange(1, len(ids) + 1, dtype=np.float32) / 10
    turn = m.Completion(ids, lps, "length", 1, 2, ((1, 0, 12), (2, 12, len(ids))),
                        forced_positions=(3, 19))  # fmt: skip

    def decode(xs):
        return "".join(chr(x) for x in xs)

    cut = cut_at_stop(turn, decode, ("</calc>",))
    k = text.index("</calc>") + len("</calc>")
    assert decode(cut.token_ids.tolist()) == "ab<calc>1+2</calc>" and len(cut.token_ids) == k
    np.testing.assert_array_equal(cut.logprobs, lps[:k])
    assert (cut.finish_reason, cut.forced_positions) == ("stop", (3,))
    assert cut.version_spans == ((1, 0, 12), (2, 12, k)) and cut.version_end == 2
    early = cut_at_stop(turn, decode, ("<calc>",))
    assert early.version_spans == ((1, 0, 8),) and early.version_end == 1
    cut.validate(), early.validate()
    assert cut_at_stop(turn, decode, ("</tool>",)) is turn
    assert cut_at_stop(turn, decode, ()) is turn
    assert cut_at_stop(turn, decode, ("xyz",)) is turn  # the stop ends the turn already


def test_an_episode_across_weight_updates_carries_each_turns_version():
    """Turns sampled at versions 0, 1 and 2 (the engine loaded new weights between turns, and
    turn 3 crossed an update at its second token): the record's spans put each turn's
    versions at its own tokens, so the lag filter and the per-token corrections see them."""
    glue = TurnGlue((90,), (91,), (92, 93))
    spans = {0: ((0, 0, 3),), 1: ((1, 0, 3),), 2: ((1, 0, 1), (2, 1, 3))}

    async def generate(p: m.Prompt):
        t = int(p.sample_id.rsplit("/t", 1)[1])
        v0, v1 = spans[t][0][0], spans[t][-1][0]
        return (m.Completion([10 + t] * 3, [-0.1] * 3, "length", v0, v1, spans[t]),)

    prompt = m.Prompt("ep", np.asarray([1, 2], np.int32), 1, m.SamplingParams(max_new_tokens=3))
    record, _, turns = asyncio.run(run_episode(
        generate, prompt, Scripted(), {"question": "q"}, lambda s: [7] * len(s.split()),
        lambda ids: "turn", glue, EpisodeLimits(3, 100),
    ))  # fmt: skip
    assert turns == 3 and (record.version_start, record.version_end) == (0, 2)
    model = [j for j in range(len(record.token_ids)) if j not in set(record.forced_positions)]
    assert record.token_ids[model].tolist() == [10] * 3 + [11] * 3 + [12] * 3
    assert record.token_versions()[model].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2]
    record.validate()
