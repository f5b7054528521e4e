"""`WeightPublisher` with an adapter (`sync.lora_only`): through the real gateway and real gloo
the engine receives only the PEFT-named LoRA tensors (A [r, in], B [out, r]) of the trainer's
model, bit for bit in fp32, the manifest carries rank, alpha and targets, and the bytes of a
push are the adapters' alone; bad set-ups are refused at construction."""

import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest

from models.checkpoints.hf_io import load_hf_checkpoint
from models.checkpoints.peft_io import adapter_tensors
from models.checkpoints.peft_layout import adapter_shapes
from models.lora import add_lora
from trainer.publish import WeightPublisher
from transport.adapter_spec import AdapterSpec
from transport.config import GlooTransportConfig, JaxTransferTransportConfig
from transport.expected import checkpoint_tensors
from transport.manifest import Manifest

_path = Path(__file__).parents[1] / "rollout_engine" / "worker_harness.py"
_spec = importlib.util.spec_from_file_location("worker_harness", _path)
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)

TARGETS = ("k_proj", "o_proj", "q_proj", "v_proj")  # attention only: a subset of the MLP too
RANK, ALPHA = 4, 8.0


def test_an_adapter_push_sends_only_the_peft_tensors(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama", seed=3)
    cfg, decoder = load_hf_checkpoint(path, dtype="float32")
    add_lora(decoder, RANK, ALPHA, TARGETS, jax.random.key(1), b_init_std=0.1)
    spec = AdapterSpec.of(RANK, ALPHA, TARGETS)
    shapes = adapter_shapes(cfg, TARGETS, RANK)
    expected = {n: (s, "float32") for n, s in shapes}
    server, trainer, engine = h.start_gateway()
    try:
        backend = h.FakeBackend(expected=expected)
        run = h.WorkerThread(engine, backend)
        run.wait_registered()
        transport = GlooTransportConfig(port=0, timeout_s=20, bucket_bytes=1 << 14)
        publisher = WeightPublisher(
            trainer, transport, "llama", cfg, "float32", ready_timeout_s=20, adapter=spec
        )
        stats = publisher.push(decoder, version=1)
        manifest = publisher.manifest(1)
        trainer.shutdown()
        assert run.join() == "shutdown"
        publisher.close()
    finally:
        trainer.close()
        engine.close()
        server.stop(0)

    assert manifest.adapter == spec
    assert Manifest.from_json(manifest.to_json()) == manifest
    reference, facts = adapter_tensors(decoder)
    assert (facts["r"], facts["lora_alpha"], tuple(facts["target_modules"])) == (4, 8.0, TARGETS)
    assert list(reference) == [n for n, _ in shapes]  # sending order: layer by layer, A then B
    assert len(reference) == 2 * len(TARGETS) * cfg.num_layers
    assert set(backend.received) == set(reference)
    for name, a in reference.items():
        np.testing.assert_array_equal(backend.received[name].numpy(), a)
    assert stats.num_bytes == sum(a.nbytes for a in reference.values())
    assert stats.num_tensors == len(reference)
    full = sum(int(np.prod(s)) * 4 for s, _ in checkpoint_tensors(path, "float32").values())
    assert stats.num_bytes < full / 4, (stats.num_bytes, full)


def test_an_adapter_push_is_refused_where_only_whole_models_go(tiny_checkpoint) -> None:
    cfg, _ = load_hf_checkpoint(tiny_checkpoint("llama", seed=3), dtype="float32")
    spec = AdapterSpec.of(RANK, ALPHA, TARGETS)
    with pytest.raises(ValueError, match=r"adapter-only push .* transport .jax_transfer"):
        WeightPublisher(None, JaxTransferTransportConfig(), "llama", cfg, adapter=spec)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown"):
        adapter_shapes(cfg, ("qkv_proj",), RANK)
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        AdapterSpec.of(0, ALPHA, TARGETS)
