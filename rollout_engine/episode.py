"""Multi-turn episodes, token in and token out, on any backend.

An episode is one token sequence after the prompt: model turns (sampled tokens with their
log-probs and weight versions) alternating with environment tokens (the chat template's turn
boundaries around each tokenized observation). `run_episode` plays one: it asks the backend for
one model turn continuing the whole history as token ids (`RolloutBackend.generate` with the
history as the prompt: vLLM's prefix cache keeps the earlier turns' KV; the JAX engine prefills
the history), decodes only that turn for the environment (`envs.base.Environment.step`),
tokenizes only the observation, and appends the ids: no earlier token is ever decoded and
re-encoded, so the trainer scores exactly the tokens the engine sampled.

The result is the one rollout record (`gateway.messages.Completion`) of the whole episode:
`token_ids` [L] = turn 1, glue + observation 1 + glue, turn 2, ...; `logprobs` [L] (0 at
environment tokens); `forced_positions` = every environment token (and any token a backend
forced), so the loss counts only what the model sampled; `version_spans` of each turn shifted
to its place (environment tokens fall between spans and are masked anyway), so the lag filter
and the off-policy corrections apply per token as for one turn; `turns` and `observations`
count the model turns and the observations between them, and `env_reward` carries the
environment's own reward (None when it scores nothing: the trainer's verifier then scores the
last model turn).

Bounds (`envs.base.EpisodeLimits`): at most `max_turns` model turns and `max_tokens` tokens after
the prompt (model and environment together; each turn's `max_new_tokens` is cut to what is
left), observations cut to `max_observation_chars` characters. An episode whose next
observation would not fit ends there with finish reason "length".

Episodes never wait for each other: each plays its own turns (its next turn is sent as soon as
its observation is ready), so a group's episodes may end at different turns. A turn ends at the
environment's stop strings inside the engine where the backend can (`RolloutBackend.generate`'s
`stop_strings`: vLLM's `stop`, the JAX engine's per-slot check after each decode step,
`rollout_engine.jax.stop_strings`); `cut_at_stop` makes the same cut for any other
backend. Faults stay in their episode: an environment whose `step` raises or takes over
`step_timeout_s` seconds ends that episode with finish reason "abort" (logged with the
error; the trainer drops such a group), the other episodes play on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from envs.base import Environment, EpisodeLimits, StepResult
from envs.registry import make_env
from gateway import messages as m

log = logging.getLogger(__name__)

Generate = Callable[..., Awaitable[tuple[m.Completion, ...]]]
"""A backend's `generate(prompt, stop_strings=...)`: G completions of one prompt
(`rollout_engine.backend.RolloutBackend.generate`; `stop_strings` is passed only when the
environment has some)."""
Encode = Callable[[str], Sequence[int]]
"""Text -> token ids, no special tokens added (an observation)."""
Decode = Callable[[Sequence[int]], str]
"""Token ids -> text, special tokens skipped (one model turn, for the environment)."""


@dataclasses.dataclass(frozen=True)
class TurnGlue:
    """The chat template's token ids around an observation.

    Attributes:
        end_of_turn: closes a model turn that did not end on it (ChatML: ``<|im_end|>``); a turn
            that ended on one of `end_ids` is not closed twice.
        before_observation: between the closed model turn and the observation (ChatML:
            ``"\\n<|im_start|>user\\n"``).
        after_observation: between the observation and the next model turn (ChatML:
            ``"<|im_end|>\\n<|im_start|>assistant\\n"``).
        end_ids: ids that end a model turn by themselves (the model's EOS ids).
    """

    end_of_turn: tuple[int, ...]
    before_observation: tuple[int, ...]
    after_observation: tuple[int, ...]
    end_ids: tuple[int, ...] = ()

    def around(self, turn: Sequence[int], observation: Sequence[int]) -> list[int]:
        """The environment's ids after model turn `turn`: closing, observation, opening."""
        closed = len(turn) > 0 and int(turn[-1]) in self.end_ids
        head = [] if closed else list(self.end_of_turn)
        return [*head, *self.before_observation, *observation, *self.after_observation]


_TURN, _OBS = "\u2063TURN\u2063", "\u2063OBSERVATION\u2063"


def chat_glue(tokenizer: Any, end_ids: Sequence[int] | None = None) -> TurnGlue:
    """The `TurnGlue` of a Hugging Face tokenizer's chat template, read off a rendered
    conversation (user, assistant `_TURN`, user `_OBS`, then the generation prompt).

    Args:
        end_ids: ids that end a model turn by themselves; None: the template's own end of turn
            (the first token after an assistant turn, when it is a special token, e.g.
            ChatML's ``<|im_end|>``).

    Raises:
        ValueError: the template does not render the sentinel turns in order (not a chat
            template of alternating user and assistant turns).
    """
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": _TURN},
        {"role": "user", "content": _OBS},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    a, o = text.find(_TURN), text.find(_OBS)
    if a < 0 or o < a:
        raise ValueError("the chat template does not render alternating user / assistant turns")
    between = list(tokenizer.encode(text[a + len(_TURN) : o], add_special_tokens=False))
    after = list(tokenizer.encode(text[o + len(_OBS) :], add_special_tokens=False))
    special = set(getattr(tokenizer, "all_special_ids", ()))
    if end_ids is None:
        end_ids = between[:1] if between and between[0] in special else []
    ends = tuple(int(i) for i in end_ids)
    head = between[:1] if between and between[0] in ends else []
    return TurnGlue(tuple(head), tuple(between[len(head) :]), tuple(after), ends)


def derived_seed(seed: int | None, salt: int) -> int | None:
    """A distinct 31-bit seed per sample and per turn from the prompt's seed (None stays
    None: the engine's own streams, already distinct per request id)."""
    return None if seed is None else (seed * 1_000_003 + salt + 1) & 0x7FFFFFFF


async def run_episode(
    generate: Generate,
    prompt: m.Prompt,
    env: Environment,
    task: Mapping[str, Any],
    encode: Encode,
    decode: Decode,
    glue: TurnGlue,
    limits: EpisodeLimits,
) -> tuple[m.Completion, float | None, int]:
    """Play one episode of `prompt` (built from `env.reset(task)`'s first observation; reset
    here again starts the environment's state) with `prompt.sampling` for every turn.

    An engine that refuses a later turn (its history outgrew the engine's context) ends the
    episode after the last model turn, finish reason "length". An environment whose `step`
    raises or takes over `limits.step_timeout_s` seconds ends it after that model turn, finish
    reason "abort" (logged as ``episode <sample id>: the environment failed at turn N: ...``).

    Returns:
        (the episode's record, the environment's last reward or None, model turns played).

    Raises:
        ValueError: the task does not fit the environment (`Environment.reset`), or the engine
            refused the first turn (the prompt does not fit it).
    """
    env.reset(task)
    ids: list[int] = []
    logprobs: list[float] = []
    forced: list[int] = []
    spans: list[tuple[int, int, int]] = []
    versions: list[int] = []
    reward: float | None = None
    finish, turns, observed, observations = "length", 0, 0, 0
    for turn in range(limits.max_turns):
        room = limits.max_tokens - len(ids)
        if room < 1:
            finish = "length"
            break
        sampling = dataclasses.replace(
            prompt.sampling,
            max_new_tokens=min(prompt.sampling.max_new_tokens, room),
            seed=derived_seed(prompt.sampling.seed, turn),
        )
        history = np.concatenate([prompt.token_ids, np.asarray(ids, np.int32)]).astype(np.int32)
        sub = dataclasses.replace(
            prompt, sample_id=f"{prompt.sample_id}/t{turn}", token_ids=history, group_size=1,
            sampling=sampling, episode=None, continues=turn > 0,
        )  # fmt: skip
        stops = {"stop_strings": tuple(env.stop_strings)} if env.stop_strings else {}
        try:
            (c,) = await generate(sub, **stops)
        except ValueError:
            if turn == 0:  # the prompt itself does not fit the engine: refused as a whole
                raise
            del ids[observed:], logprobs[observed:]  # the history outgrew the engine's context:
            forced = [j for j in forced if j < observed]  # end after the last model turn
            observations -= 1
            finish = "length"
            break
        c = cut_at_stop(c, decode, env.stop_strings)
        turns += 1
        start = len(ids)
        ids += c.token_ids.tolist()
        logprobs += c.logprobs.tolist()
        forced += [start + j for j in c.forced_positions]
        spans += [(v, start + a, start + b) for v, a, b in c.version_spans] or (
            [(c.version_start, start, len(ids))] if len(c.token_ids) else []
        )
        versions += [c.version_start, c.version_end]
        finish = c.finish_reason
        if finish == "abort":
            break
        try:
            result = await step_with_timeout(env, decode(c.token_ids.tolist()), limits)
        except Exception as e:  # the environment's fault ends its own episode only
            log.warning(
                "episode %s: the environment failed at turn %d: %s: %s",
                prompt.sample_id, turn + 1, type(e).__name__, e,
            )  # fmt: skip
            finish = "abort"
            break
        reward = result.reward if result.reward is not None else reward
        if result.done or result.observation is None or turn == limits.max_turns - 1:
            break
        text = result.observation[: limits.max_observation_chars]
        extra = glue.around(c.token_ids.tolist(), list(encode(text)))
        if len(ids) + len(extra) >= limits.max_tokens:
            finish = "length"
            break
        observed = len(ids)
        observations += 1
        forced += range(len(ids), len(ids) + len(extra))
        ids += extra
        logprobs += [0.0] * len(extra)
    record = m.Completion(
        token_ids=np.asarray(ids, np.int32),
        logprobs=np.asarray(logprobs, np.float32),
        finish_reason=finish,
        version_start=min(versions) if versions else 0,
        version_end=max(versions) if versions else 0,
        version_spans=tuple(spans),
        forced_positions=tuple(forced),
        turns=turns,
        observations=observations,
        env_reward=reward,
    )
    return record, reward, turns


async def step_with_timeout(env: Environment, turn: str, limits: EpisodeLimits) -> StepResult:
    """`env.step(turn)` in a thread of its own (a daemon: a hung environment neither blocks
    the event loop nor the process's exit), awaited at most `limits.step_timeout_s` seconds.

    Raises:
        TimeoutError: no answer in time (the thread is left to finish on its own).
        Exception: whatever `env.step` raised.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[StepResult] = loop.create_future()

    def settle(result: StepResult | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            assert result is not None
            done.set_result(result)

    def run() -> None:
        outcome: tuple[StepResult | None, BaseException | None]
        try:
            outcome = (env.step(turn), None)
        except BaseException as e:
            outcome = (None, e)
        with contextlib.suppress(RuntimeError):  # the loop closed while the step hung
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="env-step", daemon=True).start()
    try:
        return await asyncio.wait_for(done, limits.step_timeout_s)
    except TimeoutError:
        raise TimeoutError(f"no answer in {limits.step_timeout_s} s") from None


def cut_at_stop(turn: m.Completion, decode: Decode, stops: Sequence[str]) -> m.Completion:
    """`turn` ended after its shortest prefix whose text holds one of `stops` (finish "stop"),
    or `turn` itself when none occurs: the record a sampler with these stop strings would have
    made (each kept token's log-prob depends only on the tokens before it), the tokens past the
    stop dropped. A backend that ends turns at stop strings itself (vLLM, the JAX engine)
    returns turns this leaves as they are; one that samples on is cut here, so the tool call's
    closing tag is the turn's end and the model never writes past it (e.g. a result of its own).

    Args:
        turn: one model turn's completion, token ids [L].
        decode: ids -> text (special tokens skipped).
    """
    if not stops or not any(s in decode(turn.token_ids.tolist()) for s in stops):
        return turn
    ids = turn.token_ids.tolist()
    k = next(k for k in range(1, len(ids) + 1) if any(s in decode(ids[:k]) for s in stops))
    if k == len(ids):
        return turn
    spans = tuple((v, a, min(b, k)) for v, a, b in turn.version_spans if a < k)
    return dataclasses.replace(
        turn,
        token_ids=turn.token_ids[:k],
        logprobs=turn.logprobs[:k],
        finish_reason="stop",
        forced_positions=tuple(j for j in turn.forced_positions if j < k),
        version_spans=spans,
        version_end=max((v for v, _, _ in spans), default=turn.version_end),
    )


class EpisodeRunner:
    """Plays the G episodes of a prompt that carries a `gateway.messages.Episode`, on one
    backend: the engine worker's path for such prompts.

    Loads the tokenizer of the HF folder the backend serves once (on the first episode, off
    the event loop) and reads the chat template's turn ids from it (`chat_glue`). Each of the
    G samples gets its own environment (`envs.registry.make_env`) and its own sample id
    ("<sample id>/s<g>", so its turns draw their own random streams).

    Args:
        tokenizer_path: the HF folder (or hub id) whose tokenizer and chat template the
            backend's model uses.
    """

    def __init__(self, tokenizer_path: str) -> None:
        self.tokenizer_path = tokenizer_path
        self._tokenizer: Any = None
        self._glue: TurnGlue | None = None
        self._lock = asyncio.Lock()

    def _load(self) -> tuple[Any, TurnGlue]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        return tokenizer, chat_glue(tokenizer)

    async def group(self, generate: Generate, prompt: m.Prompt) -> tuple[m.Completion, ...]:
        """The G episodes of `prompt`, in sample order (each the record `run_episode` makes).

        Raises:
            ValueError: no episode, an unknown environment, a task that is not a JSON object
                or that the environment refuses (the worker returns the group aborted).
        """
        ep = prompt.episode
        if ep is None:
            raise ValueError(f"prompt {prompt.sample_id!r} carries no episode")
        try:
            task = json.loads(ep.task_json)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"prompt {prompt.sample_id!r}: the episode task is not JSON: {e}"
            ) from None
        if not isinstance(task, dict):
            raise ValueError(f"prompt {prompt.sample_id!r}: the episode task is not a JSON object")
        limits = EpisodeLimits(ep.max_turns, ep.max_tokens, ep.max_observation_chars)
        envs = [make_env(ep.env) for _ in range(prompt.group_size)]
        async with self._lock:
            if self._glue is None:
                self._tokenizer, self._glue = await asyncio.to_thread(self._load)
        tok, glue = self._tokenizer, self._glue
        assert glue is not None

        def encode(text: str) -> list[int]:
            return list(tok.encode(text, add_special_tokens=False))

        def decode(ids: Sequence[int]) -> str:
            return str(tok.decode(list(ids), skip_special_tokens=True))

        samples = [
            dataclasses.replace(
                prompt,
                sample_id=f"{prompt.sample_id}/s{g}",
                group_size=1,
                sampling=dataclasses.replace(
                    prompt.sampling, seed=derived_seed(prompt.sampling.seed, g)
                ),
            )  # fmt: skip
            for g in range(prompt.group_size)
        ]
        played = await asyncio.gather(
            *(run_episode(generate, p, env, task, encode, decode, glue, limits)
              for p, env in zip(samples, envs, strict=True))
        )  # fmt: skip
        return tuple(record for record, _, _ in played)
