"""How often bf16 greedy decoding equals fp32 greedy decoding, for the JAX engine and for vLLM,
on the same prompts in one run (issue 28).

The prompts are those of `tests/integration/test_jax_bf16_greedy.py`: 32 chat-template
arithmetic questions ("What is {3i+7} plus {5i+2}? Explain.") to SmolLM2-135M-Instruct,
`--new` (64) greedy tokens each, EOS ignored. A prompt counts as equal when all its tokens are
equal; ``first_divergence`` is the mean index of the first differing token over the prompts
that differ. The JAX engine runs fp32 then bf16 (`JaxEngine`, 32 slots); vLLM (`vllm.LLM`,
eager) runs bf16 then fp32, one engine at a time. bf16 rounding may flip a near-tie argmax,
after which the continuations part: vLLM's own bf16-vs-fp32 count is the reference for how
many prompts a bf16 engine can be expected to keep.

Usage: python benchmarks/bf16_agreement.py [--engines jax,vllm] [--new 64]
Prints one line per engine, then one JSON object on the last line: ``jax_equal``,
``vllm_equal`` (of ``prompts``), ``jax_first_divergence``, ``vllm_first_divergence``,
``jax_over_vllm_equal``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Literal

import numpy as np
from common import CPU_ENV

from models.checkpoints.smollm2 import ensure_smollm2

PROMPTS = 32


def chat_prompts(path) -> list[tuple[int, ...]]:
    """The 32 token-id prompts of the bf16 greedy test (chat template, generation prompt)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    prompts = []
    for i in range(PROMPTS):
        msg = [{"role": "user", "content": f"What is {3 * i + 7} plus {5 * i + 2}? Explain."}]
        text = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
        prompts.append(tuple(int(t) for t in tok(text, add_special_tokens=False)["input_ids"]))
    return prompts


def jax_greedy(path, prompts, dtype: str, new: int) -> list[np.ndarray]:
    """`new` greedy tokens per prompt from the JAX engine loaded in `dtype` (EOS never hit)."""
    from flax import nnx

    from models.checkpoints.hf_io import load_hf_checkpoint
    from rollout_engine.jax.batcher import BatcherConfig
    from rollout_engine.jax.engine import EngineConfig, JaxEngine
    from rollout_engine.jax.sampling import SamplingConfig
    from rollout_engine.jax.stops import StopConfig
    from rollout_engine.jax.types import Request

    cfg, model = load_hf_checkpoint(path, dtype=dtype)
    stops = StopConfig(eos_ids=(cfg.vocab_size,), pad_id=0)  # an id never sampled
    bcfg = BatcherConfig(num_slots=32, max_len=max(map(len, prompts)) + new, prefill_batch=8)
    ecfg = EngineConfig(bcfg, SamplingConfig(temperature=0.0), stops)
    with JaxEngine(cfg, nnx.split(model)[1], ecfg) as engine:
        results = engine.generate([Request(i, p, 1, new) for i, p in enumerate(prompts)])
    by_id = {r.prompt_id: np.asarray(r.tokens) for r in results}
    return [by_id[i] for i in range(len(prompts))]


def vllm_greedy(path, prompts, dtype: Literal["bfloat16", "float32"], new: int) -> list[np.ndarray]:
    """`new` greedy tokens per prompt from `vllm.LLM` in `dtype` (eager, EOS ignored); the
    engine is shut down before returning."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(path), dtype=dtype, enforce_eager=True, seed=0,
              max_model_len=max(map(len, prompts)) + new)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return [np.asarray(o.outputs[0].token_ids) for o in outs]


def agreement(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[int, float]:
    """(prompts whose tokens are all equal, mean first differing index over the others, or
    the full length when none differ)."""
    equal, firsts = 0, []
    for x, y in zip(a, b, strict=True):
        if np.array_equal(x, y):
            equal += 1
        else:
            firsts.append(int(np.argmin(x == y)))
    return equal, float(np.mean(firsts)) if firsts else float(len(a[0]))


def main() -> None:
    """Runs each engine in both dtypes and prints the counts, JSON on the last line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", default="jax,vllm")
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    path = ensure_smollm2()
    prompts = chat_prompts(path)
    out: dict[str, object] = {"model": "smollm2", "prompts": PROMPTS, "new_tokens": args.new}
    equals: dict[str, int] = {}
    for engine in args.engines.split(","):
        if engine == "jax":
            runs = {d: jax_greedy(path, prompts, d, args.new) for d in ("float32", "bfloat16")}
        elif engine == "vllm":
            os.environ.update(CPU_ENV)
            runs = {
                "bfloat16": vllm_greedy(path, prompts, "bfloat16", args.new),
                "float32": vllm_greedy(path, prompts, "float32", args.new),
            }
        else:
            raise SystemExit(f"unknown engine {engine!r}: jax or vllm")
        equal, first = agreement(runs["float32"], runs["bfloat16"])
        print(f"{engine}: bf16 greedy equals fp32 on {equal}/{PROMPTS} prompts "
              f"({args.new} tokens; first divergence at token {first:.1f} on average)")  # fmt: skip
        out[f"{engine}_equal"] = equal
        out[f"{engine}_first_divergence"] = first
        equals[engine] = equal
    if "jax" in equals and "vllm" in equals:
        out["jax_over_vllm_equal"] = equals["jax"] / max(1, equals["vllm"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
