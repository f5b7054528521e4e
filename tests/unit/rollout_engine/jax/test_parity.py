"""The engine against transformers (greedy, token for token) and against a full forward pass
(log-probs of sampled tokens), on tiny random llama and qwen2 checkpoints in fp32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from models.checkpoints.hf_io import load_hf_checkpoint
from models.checkpoints.tiny import make_tiny_checkpoint
from rollout_engine.jax.batcher import BatcherConfig
from rollout_engine.jax.engine import EngineConfig, JaxEngine
from rollout_engine.jax.sampling import SamplingConfig, truncate_logits
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

VOCAB = 320
NEW = 32
PROMPTS = [
    (5, 17, 230, 44, 9),
    tuple(range(40, 51)),
    (7, 300, 12, 88, 91, 150, 3, 64, 201, 19, 5, 77, 8, 260, 33, 41, 110, 2, 99),
]


@pytest.fixture(scope="module", params=["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def checkpoint(request, tmp_path_factory):
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param),
        request.param,
        vocab_size=VOCAB,
        with_tokenizer=False,
    )
    cfg, model = load_hf_checkpoint(path)
    return path, cfg, model


def _hf_greedy(hf, prompt: tuple[int, ...], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(hf(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def _engine(cfg, model, sampling: SamplingConfig) -> JaxEngine:
    # EOS = VOCAB is never sampled, so every sample runs to its limit
    stops = StopConfig(eos_ids=(VOCAB,), pad_id=3)
    bcfg = BatcherConfig(num_slots=4, max_len=64, prefill_batch=2)
    return JaxEngine(cfg, nnx.split(model)[1], EngineConfig(bcfg, sampling, stops))


def test_greedy_equals_transformers_token_for_token(checkpoint) -> None:
    path, cfg, model = checkpoint
    requests = [Request(i, p, num_samples=2, max_new_tokens=NEW + 1) for i, p in enumerate(PROMPTS)]
    with _engine(cfg, model, SamplingConfig(temperature=0.0)) as engine:
        results = engine.generate(requests)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert [(r.prompt_id, r.sample_index) for r in results] == [
        (i, g) for i in range(3) for g in range(2)
    ]
    for i, prompt in enumerate(PROMPTS):
        expected = _hf_greedy(hf, prompt, NEW + 1)
        for r in results[2 * i : 2 * i + 2]:
            # the EOS id is outside the vocabulary: every sample runs to the limit, and the
            # token at the limit is the greedy one (not a forced EOS)
            assert r.tokens.tolist() == expected
            assert r.finish_reason == "length" and r.forced_positions == ()


def _truncation_is_a_tie(logits: np.ndarray, sampling: SamplingConfig, eps: float = 1e-5):
    """[n] bool: the steps whose top-k / top-p kept set turns on a difference below `eps`
    (the k-th and (k+1)-th logits, or a token's preceding mass and `top_p`), where the
    engine's logits and a full forward's, equal up to summation order (~1e-6), may keep
    different tokens, and so normalise over different sets (a tiny random model's logits
    hold exact ties). `logits`: [n, V] float32, divided by the temperature."""
    desc = -np.sort(-logits, axis=-1)  # [n, V]
    tie = np.zeros(len(logits), bool)
    k = sampling.top_k
    if 0 < k < logits.shape[-1]:
        tie |= desc[:, k - 1] - desc[:, k] < eps
        desc = desc[:, :k]
    if sampling.top_p < 1.0:
        probs = np.exp(desc - desc[:, :1])
        probs /= probs.sum(-1, keepdims=True)
        before = np.cumsum(probs, axis=-1) - probs
        tie |= np.any(np.abs(before - sampling.top_p) < eps, axis=-1)
    return tie


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=0.8),
        pytest.param(SamplingConfig(temperature=1.2, top_k=40, top_p=0.9), marks=pytest.mark.slow),
    ],
)
def test_sampled_logprobs_equal_a_full_forward_recomputation(checkpoint, sampling) -> None:
    _, cfg, model = checkpoint
    requests = [Request(i, p, num_samples=3, max_new_tokens=20) for i, p in enumerate(PROMPTS)]
    with _engine(cfg, model, sampling) as engine:
        results = engine.generate(requests)
    assert len(results) == 9
    seqs = [list(PROMPTS[r.prompt_id]) + r.tokens[:-1].tolist() for r in results]
    width = max(len(q) for q in seqs)
    batch = np.zeros((len(seqs), width), np.int32)
    for i, q in enumerate(seqs):
        batch[i, : len(q)] = q
    graphdef, params = nnx.split(model)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), batch.shape)
    full = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, positions)[0])(params, batch)
    compared = 0
    for i, r in enumerate(results):
        start = len(PROMPTS[r.prompt_id]) - 1
        n = len(r.tokens)  # every token was sampled, the last one (EOS or at the limit) too
        scaled = full[i, start : start + n] / sampling.temperature  # [n, V]
        tail = truncate_logits(scaled, top_k=sampling.top_k, top_p=sampling.top_p)
        ref = jax.nn.log_softmax(tail, axis=-1)
        recomputed = np.asarray(ref[jnp.arange(n), r.tokens[:n]])
        sure = ~_truncation_is_a_tie(np.asarray(scaled), sampling)  # [n]
        np.testing.assert_allclose(r.logprobs[sure], recomputed[sure], rtol=0, atol=1e-4)
        compared += int(sure.sum())
    assert compared >= 9 * 20 - 2  # at most two steps of 180 sit on a truncation tie
    # distinct keys per sample: the three samples of a prompt differ
    assert len({tuple(r.tokens.tolist()) for r in results[:3]}) == 3
