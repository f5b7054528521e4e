"""The JAX engine takes weights through the file data plane's compressed deltas
(`transport.file_delta`): a keyframe, then a delta against it; after each update its greedy
tokens are those of a model built from the tensors sent (the bf16 cast here: the delta path
is exact, so the engine holds the cast bit for bit)."""

import asyncio

import numpy as np

from gateway import messages as m
from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig
from tests.unit.rollout_engine.jax.test_backend import PROMPTS, _greedy_reference, _scaled_model
from trainer.checkpoints.hf_io import export_tensors, load_hf_checkpoint
from trainer.checkpoints.tiny import make_tiny_checkpoint
from transport.file_delta import DeltaFileSender
from transport.manifest import Manifest


def test_a_keyframe_then_a_delta_land_exactly(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama", vocab_size=128, with_tokenizer=False)
    cfg, model = load_hf_checkpoint(path)
    base = export_tensors(model)
    first = {k: v * 1.3 for k, v in base.items()}
    second = {k: v.copy() for k, v in first.items()}
    for v in second.values():  # a step that moves every 50th value
        v.reshape(-1)[::50] *= 0.9
    versions = [first, second]
    greedy = m.SamplingParams(max_new_tokens=12, temperature=0.0)
    sender = DeltaFileSender(tmp_path / "plane", keep=2)
    bcfg = JaxBackendConfig(model=str(path), num_slots=2, max_model_len=64, temperature=0.0)

    async def scenario() -> list[list[int]]:
        backend = JaxBackend(bcfg)
        await backend.start()
        out = []
        try:
            await backend.connect_transport(
                {"kind": "file", "root": str(tmp_path / "plane"), "delta": True}
            )
            for version, tensors in enumerate(versions, start=1):
                shapes = [(n, a.shape) for n, a in tensors.items()]
                manifest = Manifest.of(version, shapes, "float32", 1 << 16)
                sent = await asyncio.to_thread(sender.send, manifest, tensors.items())
                assert sent.wire_bytes is not None
                if version == 2:  # the delta: 2% of the values changed
                    assert sent.wire_bytes < 0.2 * sent.num_bytes, sent
                stats = await backend.update_weights(manifest)
                assert stats.version == version == backend.weight_version
                p = m.Prompt(f"q{version}", np.asarray(PROMPTS[0], np.int32), 1, greedy)
                (done,) = await backend.generate(p)
                assert done.version_spans[0][0] == version
                out.append(list(done.token_ids))
        finally:
            await backend.shutdown()
        return out

    got = asyncio.run(scenario())
    for tensors, tokens in zip(versions, got, strict=True):
        assert tokens == _greedy_reference(cfg, _scaled_model(cfg, tensors), PROMPTS[0], 12)
