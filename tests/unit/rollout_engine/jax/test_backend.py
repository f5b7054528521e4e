"""The JAX engine behind the rollout backend seam: concurrent groups, refusals, and a weight
update through the file data plane that lands as the new version, token for token."""

import asyncio
import threading

import numpy as np
import pytest
from flax import nnx

from gateway import messages as m
from mappings.apply import checkpoint_to_params
from mappings.registry import get_family
from models.checkpoints.hf_io import export_tensors, load_hf_checkpoint
from models.checkpoints.tiny import make_tiny_checkpoint
from models.params import model_from_params
from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig
from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import SamplingConfig as JaxSampling
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request
from transport.file import FileSender
from transport.manifest import Manifest

PROMPTS = [[5, 9, 30, 41], [7, 8], list(range(50, 70))]


def _greedy_reference(cfg, model, prompt, max_tokens):
    graphdef, params = nnx.split(model)
    b = ContinuousBatcher(
        cfg,
        graphdef,
        params,
        BatcherConfig(num_slots=1, max_len=64),
        JaxSampling(temperature=0.0),
        StopConfig(eos_ids=tuple(cfg.eos_token_ids), pad_id=cfg.eos_token_ids[0]),
    )
    b.submit([Request("r", tuple(prompt), 1, max_tokens)])
    return b.run_until_idle()[0].tokens.tolist()


def test_groups_refusals_and_a_data_plane_update(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama", vocab_size=128, with_tokenizer=False)
    cfg, model = load_hf_checkpoint(path)
    scaled = {k: v * 1.3 for k, v in export_tensors(model).items()}
    greedy = m.SamplingParams(max_new_tokens=12, temperature=0.0)

    def prompt(sid, tokens, g=2, sampling=greedy):
        return m.Prompt(sid, np.asarray(tokens, np.int32), g, sampling)

    bcfg = JaxBackendConfig(
        model=str(path), num_slots=4, max_model_len=64, prefill_batch=2, temperature=0.0
    )

    async def scenario():
        backend = JaxBackend(bcfg)
        await backend.start()
        try:
            groups = await asyncio.gather(
                *(backend.generate(prompt(f"q{i}", p)) for i, p in enumerate(PROMPTS))
            )
            with pytest.raises(ValueError, match="started without a top-k / top-p filter"):
                await backend.generate(
                    prompt("bad", [1, 2], 1, m.SamplingParams(temperature=1.0, top_k=5))
                )
            hot = await backend.generate(
                prompt("hot", [1, 2], 3, m.SamplingParams(max_new_tokens=6))
            )
            assert len(hot) == 3  # T=1 on the greedy-started engine: per request
            with pytest.raises(ValueError, match="started with ignore_eos=False, which is comp"):
                await backend.generate(
                    prompt("bad", [1, 2], 1, m.SamplingParams(temperature=0.0, ignore_eos=True))
                )
            await backend.connect_transport({"kind": "file", "root": str(tmp_path / "plane")})
            manifest = Manifest.of(1, [(n, a.shape) for n, a in scaled.items()], "float32", 1 << 16)
            wrong = Manifest.of(1, [("model.embed_tokens.weight", (3, 4))], "float32", 1 << 16)
            with pytest.raises(ValueError, match="embed_tokens"):
                await backend.update_weights(wrong)
            assert backend.weight_version == 0
            sender = FileSender(tmp_path / "plane")
            thread = threading.Thread(target=sender.send, args=(manifest, scaled.items()))
            thread.start()
            stats = await backend.update_weights(manifest)
            thread.join()
            after = await backend.generate(prompt("q0-new", PROMPTS[0]))
            return groups, stats, after, backend.weight_version
        finally:
            await backend.shutdown()

    groups, stats, after, version = asyncio.run(scenario())
    assert [len(g) for g in groups] == [2, 2, 2]
    for g, p in zip(groups, PROMPTS, strict=True):
        expected = _greedy_reference(cfg, model, p, 12)
        assert [list(s.token_ids) for s in g] == [expected, expected]
        for s in g:
            assert len(s.logprobs) == len(s.token_ids)
            assert list(s.version_spans) == [(0, 0, len(s.token_ids))]
    assert stats.version == 1 and version == 1
    # the update landed whole: greedy output equals a model built from the scaled tensors
    expected = _greedy_reference(cfg, _scaled_model(cfg, scaled), PROMPTS[0], 12)
    assert [list(s.token_ids) for s in after] == [expected, expected]
    assert after[0].version_spans[0][0] == 1


def _scaled_model(cfg, tensors):
    loaded = {
        r.jax: a
        for r, a in checkpoint_to_params(
            get_family(cfg.family), cfg, tensors.__getitem__, set(tensors)
        )
    }
    return model_from_params(cfg, loaded)


def test_an_ignore_eos_engine_runs_every_sample_to_its_budget(tmp_path) -> None:
    """With `ignore_eos` (benchmarks) every sample is exactly max_new_tokens long, EOS sampled
    or not, and equals the normal engine's sample up to the normal one's EOS (same seed, same
    stream); a request that does not ask for it is refused."""
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama", vocab_size=16, with_tokenizer=False)
    eos = load_hf_checkpoint(path)[0].eos_token_ids[0]

    async def sample(ignore: bool, **kw) -> list[list[int]]:
        backend = JaxBackend(JaxBackendConfig(model=str(path), num_slots=8, max_model_len=128,
                                              prefill_batch=2, ignore_eos=ignore))  # fmt: skip
        await backend.start()
        try:
            sampling = m.SamplingParams(max_new_tokens=40, seed=7, ignore_eos=ignore, **kw)
            done = await backend.generate(m.Prompt("p", np.asarray([1, 2, 3], np.int32), 8,
                                                   sampling))  # fmt: skip
            if ignore:
                with pytest.raises(ValueError, match="started with ignore_eos=True"):
                    await backend.generate(
                        m.Prompt("q", np.asarray([1], np.int32), 1, m.SamplingParams())
                    )
            return [c.token_ids.tolist() for c in done]
        finally:
            await backend.shutdown()

    long, normal = asyncio.run(sample(True)), asyncio.run(sample(False))
    assert all(len(x) == 40 for x in long)
    assert any(eos in x[:-1] for x in long)  # a 16-token vocabulary samples EOS in 40 tokens
    for a, b in zip(long, normal, strict=True):
        assert b == a[: len(b)] and (len(b) == 40 or b[-1] == eos)
