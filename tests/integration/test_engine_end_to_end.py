"""Real processes end to end: the gateway, one `python -m rollout_engine` engine (vLLM, then the
JAX engine) started on tiny model A (fp32), and this test process as the trainer holding the JAX
params of tiny model B. The trainer pushes B as version 1 over gloo through `WeightPublisher`, then
submits prompts through the gateway: greedy outputs equal transformers' for B token for token,
and at temperature 0.7 the returned log-probs of the sampled tokens equal the JAX model's
`log_softmax(logits / 0.7)` of the same tokens within 1e-4; every rollout carries version 1.
The JAX engine compiles its temperature in, so its greedy and sampled checks use one engine each.
A third case pushes B from a tensor-parallel trainer (tp=2 x fsdp=2). One engine process at
a time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gateway import messages as m
from models.checkpoints.hf_io import load_hf_checkpoint
from trainer.publish import WeightPublisher
from transport.config import GlooTransportConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location(
    "vllm_helpers", Path(__file__).with_name("vllm_helpers.py")
)
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

PROMPTS = [[5, 9, 23, 7], [40, 41, 42], [17, 3, 99, 100, 12, 8, 61]]
N_GREEDY = 12
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """Tiny llamas A (the engines start on it) and B (the trainer's), B's JAX model and
    transformers' greedy references of both."""
    a, b = tiny_checkpoint("llama", seed=11), tiny_checkpoint("llama", seed=12)
    hf_a, hf_b = H.hf_model(a), H.hf_model(b)
    cfg_b, decoder_b = load_hf_checkpoint(b, dtype="float32")
    ref_a = [H.hf_greedy(hf_a, p, N_GREEDY) for p in PROMPTS]
    ref_b = [H.hf_greedy(hf_b, p, N_GREEDY) for p in PROMPTS]
    assert ref_a != ref_b  # the test can tell the models apart
    return {"A": a, "B": b, "cfg_b": cfg_b, "decoder_b": decoder_b, "ref_a": ref_a, "ref_b": ref_b}


def _submit(trainer, prompts: list[m.Prompt]) -> dict[str, m.RolloutGroup]:
    trainer.submit_prompts(prompts)
    groups = trainer.fetch_rollouts(len(prompts), timeout_s=120, min_groups=len(prompts))
    assert len(groups) == len(prompts)
    return {g.sample_id: g for g in groups}


def _greedy(prefix: str, version: int) -> list[m.Prompt]:
    sampling = m.SamplingParams(temperature=0.0, max_new_tokens=N_GREEDY)
    return [
        m.Prompt(f"{prefix}{i}", np.asarray(p, np.int32), 1, sampling, min_version=version)
        for i, p in enumerate(PROMPTS)
    ]


def _check_greedy(groups, prefix: str, refs, version: int) -> None:
    """Every engine samples each token, the one at the length limit included (no forced EOS)."""
    for i, ref in enumerate(refs):
        (c,) = groups[f"{prefix}{i}"].completions
        assert c.finish_reason == "length" and len(c.token_ids) == N_GREEDY, c
        assert c.token_ids.tolist() == ref[:N_GREEDY], (c.token_ids.tolist(), ref)
        assert c.forced_positions == ()
        assert (c.version_start, c.version_end) == (version, version)


def _push_b(trainer, models, family: str = "llama", version: int = 1, tp_shards: bool = True):
    """Push `models["decoder_b"]` as `version` through a fresh publisher (a new gloo group)."""
    transport = GlooTransportConfig(
        port=0, timeout_s=120, bucket_bytes=64 * 1024, tp_shards=tp_shards
    )
    publisher = WeightPublisher(trainer, transport, family, models["cfg_b"], "float32")
    stats = publisher.push(models["decoder_b"], version=version)
    print(f"push: {stats.num_bytes} B in {stats.seconds:.3f} s ({stats.gb_per_s:.3f} GB/s; "
          f"send {stats.send_s:.3f} s, {stats.send_gb_per_s:.3f} GB/s)")  # fmt: skip
    assert stats.version == version and stats.num_buckets > 1
    publisher.close()
    return stats


def _check_sampled_logprobs(trainer, decoder) -> None:
    sampling = m.SamplingParams(temperature=TEMPERATURE, max_new_tokens=10, seed=7)
    prompts = [
        m.Prompt(f"s{i}", np.asarray(p, np.int32), 2, sampling, min_version=1)
        for i, p in enumerate(PROMPTS)
    ]
    groups = _submit(trainer, prompts)
    checked = 0
    for i, p in enumerate(PROMPTS):
        for c in groups[f"s{i}"].completions:
            assert c.finish_reason != "abort", "the engine refused the prompt (see its log)"
            assert (c.version_start, c.version_end) == (1, 1)
            n = len(c.token_ids)  # every token sampled, the last one too
            seq = jnp.asarray([p + c.token_ids.tolist()], jnp.int32)
            positions = jnp.arange(seq.shape[1], dtype=jnp.int32)[None]
            logits, _ = decoder(seq, positions)
            logp = jax.nn.log_softmax(logits[0, len(p) - 1 : -1] / TEMPERATURE, axis=-1)
            expected = np.asarray(jnp.take_along_axis(logp, seq[0, len(p) :, None], -1))[:, 0]
            np.testing.assert_allclose(c.logprobs[:n], expected, atol=1e-4, rtol=0)
            checked += n
    assert checked >= 3 * 2 * 2  # a real number of tokens was compared


def test_vllm_engine_serves_b_after_a_push_over_gloo(tmp_path, models):
    with H.stack(tmp_path, models["A"], ["--backend", "vllm", "--vllm-max-model-len", "128"]) as (
        trainer, _, _,
    ):  # fmt: skip
        _check_greedy(_submit(trainer, _greedy("a", 0)), "a", models["ref_a"], 0)
        _push_b(trainer, models)
        _check_greedy(_submit(trainer, _greedy("b", 1)), "b", models["ref_b"], 1)
        _check_sampled_logprobs(trainer, models["decoder_b"])


def test_vllm_engine_serves_b_pushed_from_a_tp2_trainer(tmp_path, models, tiny_checkpoint):
    """The trainer holds B on a ("dp", "fsdp", "tp") = (1, 2, 2) mesh (Megatron-style: heads,
    KV heads, MLP width and vocab over tp, embed over fsdp); the push into vLLM at TP 1
    gathers every tensor from its tp x fsdp pieces, and greedy equals transformers'."""
    from models.sharding import make_mesh

    mesh = make_mesh(1, 2, devices=jax.devices()[:4], tp=2)
    cfg_b, decoder_b = load_hf_checkpoint(
        tiny_checkpoint("llama", seed=12), dtype="float32", mesh=mesh, min_shard_bytes=0
    )
    q = decoder_b.layers[0].attn.q.kernel[...].sharding.spec
    assert tuple(q) == ("fsdp", "tp", None)
    assert tuple(decoder_b.layers[0].mlp.down.kernel[...].sharding.spec) == ("tp", "fsdp")
    tp_models = {"cfg_b": cfg_b, "decoder_b": decoder_b}
    with H.stack(tmp_path, models["A"], ["--backend", "vllm", "--vllm-max-model-len", "128"]) as (
        trainer, _, _,
    ):  # fmt: skip
        _push_b(trainer, tp_models)
        _check_greedy(_submit(trainer, _greedy("b", 1)), "b", models["ref_b"], 1)
        _check_sampled_logprobs(trainer, decoder_b)


JAX_ARGS = ["--backend", "jax", "--jax-num-slots", "8", "--jax-max-model-len", "64"]
JAX_ARGS += ["--jax-prefill-batch", "4", "--jax-steps-per-call", "8"]


def test_jax_engine_greedy_equals_transformers_after_a_push(tmp_path, models):
    with H.stack(tmp_path, models["A"], [*JAX_ARGS, "--jax-temperature", "0"]) as (trainer, _, _):
        _check_greedy(_submit(trainer, _greedy("a", 0)), "a", models["ref_a"], 0)
        _push_b(trainer, models)
        _check_greedy(_submit(trainer, _greedy("b", 1)), "b", models["ref_b"], 1)


def test_jax_engine_sampled_logprobs_match_after_a_push(tmp_path, models):
    args = [*JAX_ARGS, "--jax-temperature", str(TEMPERATURE)]
    with H.stack(tmp_path, models["A"], args, sigterm=True) as (trainer, _, _):
        _push_b(trainer, models)
        _check_sampled_logprobs(trainer, models["decoder_b"])


@pytest.fixture(scope="module")
def qwen2_models(tiny_checkpoint):
    """Tiny qwen2 A and B (2 query heads, 1 KV head: at TP 2 the KV head is replicated on both
    ranks), B's JAX model split FSDP over 4 devices (each TP rank's shards gather from 2), and
    A's JAX model on one device (pushed back whole)."""
    from models.sharding import make_mesh

    a, b = tiny_checkpoint("qwen2", seed=21), tiny_checkpoint("qwen2", seed=22)
    hf_a, hf_b = H.hf_model(a), H.hf_model(b)
    mesh = make_mesh(fsdp=4, devices=jax.devices()[:4])
    cfg_b, decoder_b = load_hf_checkpoint(b, dtype="float32", mesh=mesh, min_shard_bytes=0)
    cfg_a, decoder_a = load_hf_checkpoint(a, dtype="float32")
    assert cfg_b.num_kv_heads == 1
    assert decoder_b.layers[0].attn.q.kernel[...].sharding.spec != jax.sharding.PartitionSpec()
    ref_a = [H.hf_greedy(hf_a, p, N_GREEDY) for p in PROMPTS]
    ref_b = [H.hf_greedy(hf_b, p, N_GREEDY) for p in PROMPTS]
    assert ref_a != ref_b
    return {"A": a, "B": b, "cfg_b": cfg_b, "decoder_b": decoder_b, "ref_a": ref_a, "ref_b": ref_b,
            "cfg_a": cfg_a, "decoder_a": decoder_a}  # fmt: skip


def test_vllm_tp2_engine_receives_only_its_shards_from_fsdp_params(tmp_path, qwen2_models):
    """vLLM at TP 2 (one worker process per rank, a core each); the trainer's params are FSDP
    over 4 devices and the manifest is sharded: each rank gets only its own shard (the KV head
    replicated), and the engine then serves B exactly; then A goes back as version 2 with whole
    tensors to both ranks (`tp_shards` off) and the engine serves A again."""
    args = ["--backend", "vllm", "--vllm-max-model-len", "128", "--vllm-tensor-parallel-size", "2"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    models = qwen2_models
    with H.stack(tmp_path, models["A"], args, family="qwen2", env=env) as (trainer, _, _):
        assert trainer.status().engines[0].tp_size == 2
        _check_greedy(_submit(trainer, _greedy("a", 0)), "a", models["ref_a"], 0)
        stats = _push_b(trainer, models, "qwen2")
        assert stats.tp_size == 2
        _check_greedy(_submit(trainer, _greedy("b", 1)), "b", models["ref_b"], 1)
        _check_sampled_logprobs(trainer, models["decoder_b"])
        back = {"cfg_b": models["cfg_a"], "decoder_b": models["decoder_a"]}
        stats = _push_b(trainer, back, "qwen2", version=2, tp_shards=False)
        assert stats.tp_size == 1
        _check_greedy(_submit(trainer, _greedy("a2-", 2)), "a2-", models["ref_a"], 2)
