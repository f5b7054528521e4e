"""Multi-turn episodes against single-turn rollouts of the same model tokens, per engine, in
one run: what playing an episode turn by turn (`rollout_engine.episode.run_episode`: one engine
request per turn, each continuing the whole history as token ids) costs against one request.

Workload, the same on each engine (`--engines`, default the JAX engine and vLLM):
- ``multi``: `--prompts` prompts x `--samples` episodes of exactly `--turns` model turns of
  `--turn-tokens` tokens each (EOS ignored), with a fixed observation of about
  `--observation-tokens` tokens (and the chat template's turn tokens) between turns, from a
  scripted environment (never done before the last turn);
- ``single``: the same prompts x samples as one completion of `--turns` x `--turn-tokens`
  tokens each (EOS ignored): the same model tokens in one request.
- ``--turn-tokens-mix F`` (F > 1): episodes of many shapes inside each group: sample s of
  S plays turns of ``turn_tokens * F**(s/(S-1)) / sqrt(F)`` tokens (F times longer for the
  last sample than for the first), observations scaled alike, and ``turns - s % turns``
  turns (the group's episodes end at different turns); its single completion has the same
  model tokens (one request per sample).
Both after an untimed warm-up of the same workload (the JAX engine compiles every bucket);
all episodes (or completions) submitted at once; wall seconds of one pass.

Figures per engine: ``<engine>_episodes_per_min`` and ``<engine>_single_per_min`` (episodes,
or single completions, per minute), ``<engine>_multi_model_tokens_per_s`` and
``<engine>_single_tokens_per_s`` (sampled tokens only: observation and template tokens are
not counted), and ``<engine>_multi_over_single`` = multi model tokens/s over single tokens/s
(below 1: the cost of turns: one more prefill of the observation per turn, and the requests'
round trips), ``<engine>_multi_s`` and ``<engine>_single_s`` (wall seconds).

Where the multi-turn pass's time goes, per engine (printed, `TurnClock.breakdown`): per turn,
the mean seconds from asking it to its answer, how far apart the episodes started it (an
episode never waits for its group: a spread near 0 says the engine took them together) and
the history it carried; the seconds between a turn's answer and the next ask (the
environment, tokenizing the observation). What the engine did again: the JAX engine's turns
continued in their slot (``jax_slot_hit_rate``, of the later turns) and its decode steps
against the single pass's (``jax_decode_steps_multi_over_single``); vLLM's prefix-cache hits
over the prompt tokens it looked up (``vllm_prefix_hit_rate``, vLLM's own counters). The
episodes run on the backend in this process, as the engine worker plays them (one gateway
round trip per group, none per turn); no turn here has stop strings (turns of fixed length).

Usage: python benchmarks/multi_turn.py [--model smollm2|tiny|HF_DIR] [--engines jax,vllm]
    [--prompts 16] [--samples 4] [--turns 3] [--turn-tokens 32] [--observation-tokens 16]
    [--turn-tokens-mix 1] [--slots 64] [--vllm-dtype bfloat16|float32] [--vllm-block-size 32]
    [--jax-dtype float32|bfloat16] [--jax-kv-dtype auto|bfloat16|float32]
``--jax-dtype`` (default float32): the JAX engine's dtype; bfloat16 runs its decode attention
through the native CPU kernel (`models.kernels.decode_attention`). ``--jax-kv-dtype``
(default auto: the JAX dtype): bfloat16 under a float32 engine keeps float32 matmuls with a
bfloat16 cache read by that kernel (`BatcherConfig.kv_cache_dtype`).
``--vllm-block-size`` (vLLM's KV block, tokens; 0 is vLLM's own, 128 on CPU): its prefix
cache holds whole blocks only, so a short history is found again only with small blocks.
Prints one line per measurement, then one JSON object on the last line. On a CPU without bf16
instructions (AVX2 only) vLLM computes bf16 far slower than fp32: pass --vllm-dtype float32.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from common import CPU_ENV, model_path

from envs.base import Environment, EpisodeLimits, StepResult
from gateway import messages as m
from rollout_engine.episode import chat_glue, run_episode


class FixedReplies(Environment):
    """A scripted environment: the same observation after every turn, done after `turns`."""

    name = "fixed_replies"

    def __init__(self, observation: str, turns: int) -> None:
        self.observation, self.turns, self.seen = observation, turns, 0

    def reset(self, task: Mapping[str, Any]) -> str:
        self.seen = 0
        return str(task.get("question", ""))

    def step(self, turn: str) -> StepResult:
        self.seen += 1
        done = self.seen >= self.turns
        return StepResult(None if done else self.observation, None, done)


def make_backend(engine: str, path: Path, args, max_len: int):
    """The project's backend of `engine` on `path`, not started."""
    if engine == "jax":
        from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig

        return JaxBackend(JaxBackendConfig(model=str(path), num_slots=args.slots,
                                           max_model_len=max_len, prefill_batch=16,
                                           steps_per_call=8, ignore_eos=True,
                                           dtype=args.jax_dtype,
                                           kv_cache_dtype=args.jax_kv_dtype))  # fmt: skip
    import os

    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    from rollout_engine.vllm.backend import VllmBackend, VllmBackendConfig

    return VllmBackend(
        VllmBackendConfig(
            model=str(path),
            dtype=args.vllm_dtype,
            max_model_len=max_len,
            block_size=args.vllm_block_size,
        )  # fmt: skip
    )


def shapes(args) -> list[tuple[int, int, int]]:
    """(turn tokens, observation words, turns) of each sample of a group (see the module
    docstring: all alike unless `--turn-tokens-mix`)."""
    f, n = args.turn_tokens_mix, args.samples
    if f <= 1:
        return [(args.turn_tokens, args.observation_tokens, args.turns)] * n
    scale = [f ** (s / max(n - 1, 1)) / f**0.5 for s in range(n)]
    return [
        (max(1, round(args.turn_tokens * x)), max(1, round(args.observation_tokens * x)),
         args.turns - s % args.turns)
        for s, x in enumerate(scale)
    ]  # fmt: skip


class TurnClock:
    """`backend.generate` with a clock: one row per model turn asked, (episode, turn index,
    seconds asked, seconds answered, history tokens, sampled tokens), times from `origin`."""

    def __init__(self, generate: Callable, origin: float) -> None:
        self.generate, self.origin = generate, origin
        self.rows: list[tuple[str, int, float, float, int, int]] = []

    async def __call__(self, prompt: m.Prompt, **kw: Any) -> tuple[m.Completion, ...]:
        t0 = time.perf_counter() - self.origin
        out = await self.generate(prompt, **kw)
        episode, turn = prompt.sample_id.rsplit("/t", 1)
        self.rows.append((episode, int(turn), t0, time.perf_counter() - self.origin,
                          len(prompt.token_ids), len(out[0].token_ids)))  # fmt: skip
        return out

    def breakdown(self, turns: int) -> dict[str, float]:
        """Where a pass's seconds go, per turn index t (1-based): ``turn<t>_engine_s`` (mean
        seconds from asking a turn to its answer: queueing, the prefill of the history, the
        decode), ``turn<t>_spread_s`` (the last episode's start of turn t minus the first's:
        how far the episodes drifted apart), ``turn<t>_history_tokens`` (mean prompt of turn
        t); ``between_turns_s`` (mean seconds from a turn's answer to the next turn's ask of
        the same episode: the environment's step, tokenizing the observation, the runner)."""
        out: dict[str, float] = {}
        for t in range(turns):
            rows = [r for r in self.rows if r[1] == t]
            if not rows:
                continue
            out[f"turn{t + 1}_engine_s"] = float(np.mean([b - a for _, _, a, b, _, _ in rows]))
            starts = [a for _, _, a, _, _, _ in rows]
            out[f"turn{t + 1}_spread_s"] = max(starts) - min(starts)
            out[f"turn{t + 1}_history_tokens"] = float(np.mean([r[4] for r in rows]))
        by_episode: dict[str, dict[int, tuple[float, float]]] = {}
        for e, t, a, b, _, _ in self.rows:
            by_episode.setdefault(e, {})[t] = (a, b)
        gaps = [turns_[t + 1][0] - turns_[t][1] for turns_ in by_episode.values()
                for t in turns_ if t + 1 in turns_]  # fmt: skip
        out["between_turns_s"] = float(np.mean(gaps)) if gaps else 0.0
        return out


def engine_counters(backend) -> dict[str, float]:
    """The engine's running totals the breakdown reads: the JAX engine's decode steps, prompt
    rows prefilled whole, turns continued in their slot (slot memory) and history tokens they
    did not prefill again, prompt tokens prefilled behind a shared prefix;
    vLLM's prefix-cache queries and hits (tokens, its ``vllm:prefix_cache_*`` counters)."""
    replicas = getattr(getattr(backend, "engine", None), "replicas", None)
    if replicas is not None:
        return {
            "decode_steps": sum(r.decode_steps for r in replicas),
            "prefilled_rows": sum(r.prefilled_rows for r in replicas),
            "continued": sum(r.continued for r in replicas),
            "reused_tokens": sum(r.reused_tokens for r in replicas),
            "shared_prefix_tokens": sum(r.shared_prefix_tokens for r in replicas),
        }
    from rollout_engine.vllm.prefix_cache import prefix_cache_counts

    got = prefix_cache_counts()
    return {"prefix_queries": got.queries, "prefix_hits": got.hits}


def counted(before: dict[str, float], after: dict[str, float], tag: str) -> dict[str, float]:
    """``after - before`` of each counter, the keys prefixed with `tag`."""
    return {f"{tag}_{k}": after[k] - before[k] for k in after}


async def one_pass(
    backend, prompts: list[np.ndarray], args, glue, encode: Callable, decode: Callable, tag: str
) -> dict[str, float]:
    """One pass of each workload; returns wall seconds and model tokens of both, the turn
    breakdown of the multi-turn pass (`TurnClock.breakdown`) and the engine's counters of
    each pass (`engine_counters`, keys ``multi_*`` and ``single_*``)."""
    shape = shapes(args)

    def sampling(tokens: int) -> m.SamplingParams:
        return m.SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)

    out: dict[str, float] = {}
    before = engine_counters(backend)
    t = time.perf_counter()
    clock = TurnClock(backend.generate, t)
    played = await asyncio.gather(*(
        run_episode(clock, m.Prompt(f"{tag}m{i}/{s}", ids, 1, sampling(n)),
                    FixedReplies(" ".join(["ok"] * o), k), {"question": "q"}, encode, decode,
                    glue, EpisodeLimits(k, 100_000, 100_000))
        for i, ids in enumerate(prompts) for s, (n, o, k) in enumerate(shape)
    ))  # fmt: skip
    out["multi_s"] = time.perf_counter() - t
    out |= clock.breakdown(args.turns)
    middle = engine_counters(backend)
    out |= counted(before, middle, "multi")
    forced = sum(len(r.forced_positions) for r, _, _ in played)
    out["multi_tokens"] = sum(len(r.token_ids) for r, _, _ in played) - forced
    out["episodes"] = len(played)
    want = [k for _ in prompts for _, _, k in shape]
    assert [turns for _, _, turns in played] == want, "an episode ended early"
    t = time.perf_counter()
    whole = sampling(args.turns * args.turn_tokens)
    if args.turn_tokens_mix <= 1:  # one request of G samples per prompt
        requests = [m.Prompt(f"{tag}s{i}", ids, args.samples, whole)
                    for i, ids in enumerate(prompts)]  # fmt: skip
    else:  # one request per sample: each has its own length
        requests = [m.Prompt(f"{tag}s{i}/{s}", ids, 1, sampling(k * n))
                    for i, ids in enumerate(prompts)
                    for s, (n, _, k) in enumerate(shape)]  # fmt: skip
    groups = await asyncio.gather(*(backend.generate(r) for r in requests))
    out["single_s"] = time.perf_counter() - t
    out |= counted(middle, engine_counters(backend), "single")
    out["single_tokens"] = sum(len(c.token_ids) for g in groups for c in g)
    out["singles"] = sum(len(g) for g in groups)
    return out


def run_engine(engine: str, path: Path, args) -> dict[str, float]:
    """Both workloads on one engine (warm-up pass, then the timed pass)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    glue = chat_glue(tok)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": f"Task {i}: go on."}],
                                tokenize=False, add_generation_prompt=True)
        for i in range(args.prompts)
    ]  # fmt: skip
    prompts = [np.asarray(tok.encode(t, add_special_tokens=False), np.int32) for t in texts]
    longest = max(k * (n + o + 16) for n, o, k in shapes(args))
    max_len = int(np.ceil((max(map(len, prompts)) + longest) / 16) * 16)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    def decode(ids) -> str:
        return str(tok.decode(list(ids), skip_special_tokens=True))

    async def go() -> dict[str, float]:
        backend = make_backend(engine, path, args, max_len)
        await backend.start()
        try:
            await one_pass(backend, prompts, args, glue, encode, decode, "w")
            return await one_pass(backend, prompts, args, glue, encode, decode, "t")
        finally:
            await backend.shutdown()

    got = asyncio.run(go())
    later = sum(k - 1 for _, _, k in shapes(args)) * args.prompts  # turns after the first
    extra: dict[str, float] = {}
    if engine == "jax":  # later turns continued in their slots (slot memory)
        print(f"jax: {got['multi_continued']:.0f} of {later} later turns continued in their "
              f"slot, {got['multi_reused_tokens']:.0f} history tokens not prefilled again; "
              f"decode steps {got['multi_decode_steps']:.0f} multi-turn, "
              f"{got['single_decode_steps']:.0f} single; whole-prompt prefill rows "
              f"{got['multi_prefilled_rows']:.0f} multi-turn, "
              f"{got['single_prefilled_rows']:.0f} single")  # fmt: skip
        extra = {"jax_slot_hit_rate": got["multi_continued"] / max(later, 1),
                 "jax_decode_steps_multi_over_single":
                     got["multi_decode_steps"] / max(got["single_decode_steps"], 1)}  # fmt: skip
    else:
        rate = got["multi_prefix_hits"] / max(got["multi_prefix_queries"], 1)
        print(f"vllm: prefix cache hit {got['multi_prefix_hits']:.0f} of "
              f"{got['multi_prefix_queries']:.0f} prompt tokens in the multi-turn pass "
              f"({rate:.2f})")  # fmt: skip
        extra = {"vllm_prefix_hit_rate": rate}
    turns = {k: round(v, 3) for k, v in got.items()
             if k.startswith("turn") or k == "between_turns_s"}  # fmt: skip
    print(f"{engine} turn breakdown (multi-turn pass): {json.dumps(turns)}")
    multi_tps = got["multi_tokens"] / got["multi_s"]
    single_tps = got["single_tokens"] / got["single_s"]
    print(f"{engine} multi: {got['episodes']:.0f} episodes (shapes {shapes(args)}), "
          f"{got['multi_tokens']:.0f} model tokens in {got['multi_s']:.2f} s = "
          f"{multi_tps:.1f} tokens/s")  # fmt: skip
    print(f"{engine} single: {got['singles']:.0f} completions, {got['single_tokens']:.0f} tokens "
          f"in {got['single_s']:.2f} s = {single_tps:.1f} tokens/s")  # fmt: skip
    return {
        f"{engine}_episodes_per_min": got["episodes"] / got["multi_s"] * 60,
        f"{engine}_single_per_min": got["singles"] / got["single_s"] * 60,
        f"{engine}_multi_model_tokens_per_s": multi_tps,
        f"{engine}_single_tokens_per_s": single_tps,
        f"{engine}_multi_over_single": multi_tps / single_tps,
        f"{engine}_multi_s": got["multi_s"],
        f"{engine}_single_s": got["single_s"],
        **extra,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--engines", default="jax,vllm")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--observation-tokens", type=int, default=16)
    ap.add_argument("--turn-tokens-mix", type=float, default=1.0)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--jax-dtype", default="float32", choices=("bfloat16", "float32"))
    ap.add_argument("--jax-kv-dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    ap.add_argument("--vllm-block-size", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        result: dict[str, Any] = {"model": args.model, "turns": args.turns,
                                  "turn_tokens": args.turn_tokens,
                                  "turn_tokens_mix": args.turn_tokens_mix,
                                  "episodes": args.prompts * args.samples,
                                  "vllm_dtype": args.vllm_dtype, "jax_dtype": args.jax_dtype,
                                  "jax_kv_dtype": args.jax_kv_dtype,
                                  "vllm_block_size": args.vllm_block_size}  # fmt: skip
        for engine in args.engines.split(","):
            result.update(run_engine(engine, path, args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
