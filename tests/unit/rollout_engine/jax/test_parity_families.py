"""The engine against transformers, greedy and token for token, for the families that
``test_parity.py`` does not cover: tiny qwen3, gemma3 (sliding-window layers), the mixtures of
experts qwen3_moe and olmoe (top-2 of 8 and of 4 experts, exact dispatch) and llama with
``attention_bias`` (biases on q, k, v and o_proj; 8 query heads per KV head), and the real
SmolLM2-135M-Instruct (slow).

Every case runs a batch of prompts of different lengths and different token budgets through
the continuous batcher with fewer slots than prompts, so samples finish at different steps and
queued prompts are substituted into freed slots mid-flight. The reference is transformers'
greedy decoding in fp32: a full forward pass per token (no KV cache) for the tiny models,
``generate`` with its KV cache for SmolLM2 (a full pass per token takes minutes there).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from models.checkpoints.hf_io import load_hf_checkpoint
from models.checkpoints.smollm2 import smollm2_available, smollm2_path
from models.checkpoints.tiny import TINY_CONFIGS
from rollout_engine.jax.batcher import BatcherConfig
from rollout_engine.jax.engine import EngineConfig, JaxEngine
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

VOCAB = 320
PROMPTS = [
    (5, 17, 230, 44, 9),
    tuple(range(40, 51)),
    (7, 300, 12, 88, 91, 150, 3, 64, 201, 19, 5, 77, 8, 260, 33, 41, 110, 2, 99),
    (11, 12, 13, 14, 15, 16, 17),
]
# completion budgets (the token sampled at the limit included): >= 33 greedy tokens, staggered ends
BUDGETS = (33, 40, 33, 36)
SMOL_QUESTIONS = [
    "What is 2 plus 3?",
    "Name three colors of the rainbow and say which one you like best.",
    "Hi",
    "Write one sentence about the sea, then one about mountains, then add 12 and 30.",
]


def _hf_greedy(hf, prompt: tuple[int, ...], n: int) -> list[int]:
    """n greedy tokens of ``hf`` after ``prompt``: full forward each step, no cache."""
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(hf(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def _hf_generate(hf, prompt: tuple[int, ...], n: int) -> list[int]:
    """n greedy tokens of ``hf.generate`` (its KV cache; EOS does not stop it): for a real model,
    where a full forward per token is too slow for the test suite on two cores."""
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt) :].tolist()


def _unused_id(expected: list[list[int]]) -> int:
    """The smallest token id no reference completion holds: an in-vocabulary EOS that greedy
    decoding never meets, so every sample runs to its budget (an id >= V would be fed to the
    embedding for finished slots, see ``test_out_of_vocab_forced_eos_...`` below)."""
    seen = {t for seq in expected for t in seq}
    return next(i for i in range(10, 10**9) if i not in seen)


def _greedy_parity(path, prompts, budgets, max_len: int, reference=_hf_greedy) -> None:
    """transformers' greedy tokens (by ``reference``) == the engine's, for two calls through
    one engine (the second in reverse order, so each prompt lands in another slot next to
    other prompts)."""
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    expected = [reference(hf, p, n) for p, n in zip(prompts, budgets, strict=True)]
    eos = _unused_id(expected)
    cfg, model = load_hf_checkpoint(path)
    ecfg = EngineConfig(
        BatcherConfig(num_slots=2, max_len=max_len, prefill_batch=2),
        SamplingConfig(temperature=0.0),
        StopConfig(eos_ids=(eos,), pad_id=3),
    )
    requests = [Request(i, p, 1, n) for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))]
    with JaxEngine(cfg, nnx.split(model)[1], ecfg) as engine:
        first = engine.generate(requests)
        again = engine.generate(
            [Request(f"again-{r.prompt_id}", r.prompt, 1, r.max_new_tokens) for r in requests][::-1]
        )[::-1]
    for results in (first, again):
        for r, want, n in zip(results, expected, budgets, strict=True):
            # n greedy tokens, the one at the limit included (no forced EOS replaces it)
            assert r.tokens.tolist() == want, f"prompt {r.prompt_id}"
            assert r.finish_reason == "length" and r.forced_positions == ()
            assert r.weight_versions == [(0, 0, n)]


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "llama_bias", "qwen3_moe", "olmoe"])
def test_tiny_greedy_equals_transformers_token_for_token(tiny_checkpoint, family) -> None:
    path = tiny_checkpoint(family, vocab_size=VOCAB, with_tokenizer=False)
    _greedy_parity(path, PROMPTS, BUDGETS, max_len=64)


def test_gemma3_sliding_window_shapes_the_reference(tiny_checkpoint) -> None:
    """The tiny gemma3's window (4) is shorter than every prompt plus its 32 tokens, and it
    changes transformers' greedy output of every prompt: the parity above covers the window."""
    path = tiny_checkpoint("gemma3", vocab_size=VOCAB, with_tokenizer=False)
    window = TINY_CONFIGS["gemma3"]["sliding_window"]
    assert all(len(p) + 32 > window for p in PROMPTS)
    full = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, sliding_window=4096
    ).eval()
    windowed = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt in PROMPTS:
        assert _hf_greedy(full, prompt, 32) != _hf_greedy(windowed, prompt, 32)


@pytest.mark.slow
@pytest.mark.skipif(
    not smollm2_available(),
    reason=f"SmolLM2-135M is not converted at {smollm2_path()} "
    "(run `python -m models.checkpoints.smollm2`)",
)
def test_smollm2_greedy_equals_transformers_token_for_token() -> None:
    from transformers import AutoTokenizer

    path = smollm2_path()
    tok: Any = AutoTokenizer.from_pretrained(str(path))
    prompts = [
        tuple(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for q in SMOL_QUESTIONS
    ]
    assert len({len(p) for p in prompts}) == len(prompts)
    max_len = max(len(p) for p in prompts) + max(BUDGETS)
    _greedy_parity(path, prompts, BUDGETS, max_len=max_len, reference=_hf_generate)


def test_out_of_vocab_forced_eos_does_not_poison_reused_slots(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3", vocab_size=VOCAB, with_tokenizer=False)
    cfg, model = load_hf_checkpoint(path)
    ecfg = EngineConfig(
        BatcherConfig(num_slots=2, max_len=64, prefill_batch=2),
        SamplingConfig(temperature=0.0),
        StopConfig(eos_ids=(VOCAB,), pad_id=3),
    )
    requests = [Request(i, p, 1, n) for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS, strict=True))]
    with JaxEngine(cfg, nnx.split(model)[1], ecfg) as engine:
        first = engine.generate(requests)
        again = engine.generate(
            [Request(f"again-{r.prompt_id}", r.prompt, 1, r.max_new_tokens) for r in requests]
        )
    for a, b in zip(first, again, strict=True):
        assert np.isfinite(b.logprobs).all()
        assert a.tokens.tolist() == b.tokens.tolist()
