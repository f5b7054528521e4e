"""The JAX engine's bf16 path against its fp32 path and transformers fp32 on the real
SmolLM2-135M (issue 28): greedy tokens equal, log-probs within a bf16 bound."""

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.checkpoints.hf_io import load_hf_checkpoint
from models.checkpoints.smollm2 import ensure_smollm2
from rollout_engine.jax.batcher import BatcherConfig
from rollout_engine.jax.engine import EngineConfig, JaxEngine
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

pytestmark = pytest.mark.slow

NEW = 64
#: Prompts (of 32) whose 64 greedy tokens must be equal in bf16 and fp32: bf16 rounding may
#: flip a near-tie argmax, after which the two continuations part.
MIN_EQUAL = 30
#: Largest |bf16 engine - transformers fp32| log-prob (nats) of a chosen token, over the
#: tokens before the first fp32/bf16 divergence: bf16 keeps 8 mantissa bits (relative error
#: 2^-9 per rounding); through 30 layers that moves logits by tenths of a nat.
BF16_LOGPROB_ATOL = 0.5


@pytest.fixture(scope="module")
def smollm2():
    """(path, [32] chat-template prompts of real arithmetic questions)."""
    path = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(str(path))
    prompts = []
    for i in range(32):
        msg = [{"role": "user", "content": f"What is {3 * i + 7} plus {5 * i + 2}? Explain."}]
        text = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        prompts.append(tuple(int(t) for t in ids))
    return path, prompts


def _greedy(path, prompts, dtype: str):
    cfg, model = load_hf_checkpoint(path, dtype=dtype)
    stops = StopConfig(eos_ids=(cfg.vocab_size,), pad_id=0)  # never sampled: 64 tokens each
    max_len = max(map(len, prompts)) + NEW
    bcfg = BatcherConfig(num_slots=32, max_len=max_len, prefill_batch=8)
    ecfg = EngineConfig(bcfg, SamplingConfig(temperature=0.0), stops)
    with JaxEngine(cfg, nnx.split(model)[1], ecfg) as engine:
        results = engine.generate([Request(i, p, 1, NEW) for i, p in enumerate(prompts)])
    results = sorted(results, key=lambda r: r.prompt_id)
    return [np.asarray(r.tokens) for r in results], [np.asarray(r.logprobs) for r in results]


@pytest.mark.xfail(
    strict=True,
    reason="issue 28: the bf16 engine's 64 greedy tokens equal fp32's on 22 of 32 prompts "
    "with the float32 residual stream (benchmarks/bf16_agreement.py; vLLM bf16 keeps 8 of "
    "its fp32's), not the 30 asked for",
)
def test_bf16_greedy_equals_fp32_and_logprobs_within_bf16_bound(smollm2) -> None:
    path, prompts = smollm2
    tok32, _ = _greedy(path, prompts, "float32")
    tok16, lp16 = _greedy(path, prompts, "bfloat16")
    assert all(len(t) == NEW for t in tok32 + tok16)
    equal = sum(np.array_equal(a, b) for a, b in zip(tok32, tok16, strict=True))
    assert equal >= MIN_EQUAL, f"only {equal} of 32 prompts' greedy tokens equal fp32's"

    hf = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    worst = 0.0
    for prompt, a, b, lp in zip(prompts, tok32, tok16, lp16, strict=True):
        same = int(np.argmin(a == b)) if not np.array_equal(a, b) else NEW
        seq = torch.tensor([list(prompt) + b.tolist()])
        with torch.no_grad():
            logits = hf(seq).logits[0, len(prompt) - 1 : len(prompt) - 1 + NEW]
        ref = torch.log_softmax(logits.float(), -1)[torch.arange(NEW), torch.tensor(b)].numpy()
        worst = max(worst, float(np.abs(lp[:same] - ref[:same]).max(initial=0.0)))
    print(f"equal greedy: {equal}/32; worst |bf16 - transformers fp32| log-prob {worst:.4f}")
    assert worst <= BF16_LOGPROB_ATOL
