"""Evaluation throughput and agreement of the two engines: problems per minute of vLLM and of the
JAX engine on the same benchmark problems, greedy, in the same run (the ratio), the fraction of
problems whose completions agree token for token, and both accuracies (math-verify).

Each engine runs in this process behind the rollout backend seam
(`rollout_engine.backend.RolloutBackend`, what `python -m rollout_engine` serves): it is started
(not timed), warmed up (not timed: every prompt at 2 new tokens and the longest at the full budget,
so the JAX engine compiles each prefill and decode bucket there), then every problem is submitted
at once and the wall time until the last completion is back gives problems per minute. Prompts are
the problems as the user turn of the tokenizer's chat template (`trainer.launch.data.make_encoder`,
what the eval command sends); completions are scored with `trainer.rewards.MathVerifier`.

With the defaults this is issue 15's benchmark (64 GSM8K test problems). The same script gives its
agreement figure: ``--data gsm8k,amc23 --limits 200,0 --max-new-tokens 256`` (the first 200 GSM8K
test problems and all of AMC23; each data set is reported on its own, and the JSON's ``datasets``
holds each one's agreement and accuracies).

Usage: python benchmarks/eval_throughput.py [--model smollm2|tiny|HF_DIR] [--data gsm8k]
    [--limits 64] [--max-new-tokens 256] [--engines vllm,jax] [--warmup 1] [--slots 64]
    [--dtype float32]
Data files come from ``$JAXRL_DATA_DIR`` (`trainer.eval.benchmarks`). Prints one line per
measurement, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import model_path

from gateway import messages as m
from rollout_engine.backend import RolloutBackend
from trainer.data.jsonl_problems import load_jsonl_problems
from trainer.data.problem import Problem
from trainer.eval.benchmarks import benchmark_file
from trainer.launch.data import make_decoder, make_encoder


def load_problems(names: list[str], limits: list[int]) -> dict[str, list[Problem]]:
    """name -> its first `limit` problems (0: all) of each named benchmark file.

    Raises:
      KeyError, FileNotFoundError: as `trainer.eval.benchmarks.benchmark_file`.
    """
    out = {}
    for name, limit in zip(names, limits, strict=True):
        bench, path = benchmark_file(name)
        out[name] = load_jsonl_problems(
            path, template=bench.template, answer_field=bench.answer_field,
            answer_form=bench.answer_form, limit=limit or None,
        )  # fmt: skip
    return out


def make_backend(engine: str, path: Path, max_len: int, args: argparse.Namespace) -> RolloutBackend:
    """The engine's backend, not started: vLLM (enforce_eager) or the JAX engine with
    ``--slots`` slots, both in ``--dtype`` with a context of `max_len` tokens."""
    if engine == "vllm":
        from rollout_engine.vllm.backend import VllmBackend, VllmBackendConfig

        return VllmBackend(VllmBackendConfig(model=str(path), dtype=args.dtype,
                                             max_model_len=max_len))  # fmt: skip
    from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig

    return JaxBackend(JaxBackendConfig(model=str(path), dtype=args.dtype, max_model_len=max_len,
                                       num_slots=args.slots, temperature=0.0))  # fmt: skip


def run_engine(
    engine: str, path: Path, prompts: list[list[int]], max_len: int, args: argparse.Namespace
) -> tuple[list[tuple[int, ...]], float]:
    """Greedy completions (token ids, one per prompt, in order) and the timed wall seconds of
    one engine on `prompts`. Untimed: the start, and (``--warmup 1``) a warm-up of every prompt
    at 2 new tokens beside the longest at the full budget, which compiles every prefill shape
    and attention bound of the JAX engine.

    Raises:
      RuntimeError: the engine failed (its own error).
    """
    sampling = m.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)

    def prompt(sample_id: str, ids: list[int], params: m.SamplingParams) -> m.Prompt:
        return m.Prompt(sample_id, np.asarray(ids, np.int32), group_size=1, sampling=params)

    async def go() -> tuple[list[tuple[m.Completion, ...]], float]:
        backend = make_backend(engine, path, max_len, args)
        t = time.perf_counter()
        await backend.start()
        print(f"{engine}: started in {time.perf_counter() - t:.1f} s", flush=True)
        try:
            t = time.perf_counter()
            if args.warmup:  # every prompt's prefill shape, and the longest's decode buckets
                short = m.SamplingParams(max_new_tokens=2, temperature=0.0)
                longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
                await asyncio.gather(
                    backend.generate(prompt("w-long", prompts[longest], sampling)),
                    *(backend.generate(prompt(f"w{i}", p, short)) for i, p in enumerate(prompts)),
                )
                print(f"{engine}: warm-up in {time.perf_counter() - t:.1f} s", flush=True)
            t = time.perf_counter()
            groups = await asyncio.gather(
                *(backend.generate(prompt(f"p{i}", p, sampling)) for i, p in enumerate(prompts))
            )
            wall = time.perf_counter() - t
        finally:
            await backend.shutdown()
        return list(groups), wall

    groups, wall = asyncio.run(go())
    return [tuple(int(t) for t in g[0].token_ids) for g in groups], wall


def main() -> None:
    """Runs both engines on the same problems; prints per-engine figures, the ratio, the
    agreement and accuracies per data set, and the JSON object last."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--data", default="gsm8k", help="benchmark names, comma-separated")
    parser.add_argument("--limits", default="64", help="problems per data set (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--engines", default="vllm,jax")
    parser.add_argument("--warmup", type=int, default=1, help="1: warm up first, 0: do not")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    names = args.data.split(",")
    limits = [int(x) for x in args.limits.split(",")]
    if len(limits) == 1:
        limits *= len(names)
    if len(limits) != len(names):
        parser.error("--limits takes one number or one per --data name")
    engines = args.engines.split(",")
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from transformers import AutoTokenizer

    from trainer.rewards import MathVerifier

    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        encode, decode = make_encoder(tokenizer, None), make_decoder(tokenizer)
        by_name = load_problems(names, limits)
        problems = [p for name in names for p in by_name[name]]
        prompts = [encode(p) for p in problems]
        max_len = max(map(len, prompts)) + args.max_new_tokens
        longest = max_len - args.max_new_tokens
        print(f"{len(problems)} problems ({args.data}), prompts up to {longest} tokens, "
              f"{args.max_new_tokens} new tokens, greedy", flush=True)  # fmt: skip
        completions: dict[str, list[tuple[int, ...]]] = {}
        out: dict[str, Any] = {"model": args.model, "data": names, "limits": limits,
                               "problems": len(problems), "max_new_tokens": args.max_new_tokens,
                               "dtype": args.dtype}  # fmt: skip
        for engine in engines:
            completions[engine], wall = run_engine(engine, path, prompts, max_len, args)
            rate = len(problems) / wall * 60.0
            tokens = sum(map(len, completions[engine]))
            print(f"{engine}: {len(problems)} problems in {wall:.1f} s = {rate:.2f} problems/min "
                  f"({tokens / wall:.1f} tokens/s)", flush=True)  # fmt: skip
            out[f"{engine}_problems_per_min"] = rate
            out[f"{engine}_tokens_per_s"] = tokens / wall
        verifier = MathVerifier()
        scores = {
            e: [verifier.score(decode(c), p) for c, p in zip(completions[e], problems, strict=True)]
            for e in engines
        }
        datasets: dict[str, dict[str, Any]] = {}
        start = 0
        for name in names:
            n = len(by_name[name])
            part = slice(start, start + n)
            start += n
            d: dict[str, Any] = {"problems": n}
            for e in engines:
                d[f"{e}_correct"] = int(sum(scores[e][part]))
                d[f"{e}_accuracy"] = d[f"{e}_correct"] / n
            if len(engines) == 2:
                a, b = (completions[e][part] for e in engines)
                d["agree"] = sum(x == y for x, y in zip(a, b, strict=True))
                d["agree_fraction"] = d["agree"] / n
            datasets[name] = d
            accs = ", ".join(f"{e} {d[f'{e}_correct']}/{n} = {d[f'{e}_accuracy']:.3f}"
                             for e in engines)  # fmt: skip
            agree = f"; same completion on {d['agree']}/{n} = {d['agree_fraction']:.3f}"
            print(f"{name}: accuracy {accs}" + (agree if "agree" in d else ""))
        out["datasets"] = datasets
        if len(engines) == 2:
            a, b = engines
            out[f"{b}_over_{a}"] = out[f"{b}_problems_per_min"] / out[f"{a}_problems_per_min"]
            out["agree_fraction"] = sum(d["agree"] for d in datasets.values()) / len(problems)
            print(f"{b}/{a} problems per minute: {out[f'{b}_over_{a}']:.3f}; same completion on "
                  f"{out['agree_fraction']:.3f} of all problems")  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
