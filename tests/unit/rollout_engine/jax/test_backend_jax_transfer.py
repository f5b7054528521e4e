"""The JAX engine over jax_transfer against the same engine over gloo.

Two senders (each its own transfer server, at 127.0.0.1 and 127.0.0.2) serve the row halves of
every tensor of version 1 (the tiny model's weights scaled by 1.3); one JAX engine pulls them
onto its device, another receives the same tensors over gloo. Both then decode the same prompts
greedily: the same tokens, and log-probs within 1e-6. Then version 2 is refused twice (a
manifest that does not fit the model, and a data-plane offer of another manifest than the
plan's): the engine still serves version 1, token for token and log-prob for log-prob.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from gateway import messages as m
from models.checkpoints.hf_io import export_tensors, load_hf_checkpoint
from models.checkpoints.tiny import make_tiny_checkpoint
from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig
from transport.base import TransferError
from transport.config import GlooTransportConfig
from transport.factory import make_sender
from transport.jax_transfer import JaxTransferSender
from transport.manifest import Manifest, ManifestError

PROMPTS = [[5, 9, 30, 41], [7, 8], list(range(50, 70))]
HOSTS = ("127.0.0.1", "127.0.0.2")


def _two_senders(manifest: Manifest) -> Manifest:
    """`manifest` with 2 senders: sender 0 holds the first half of each tensor's rows, sender
    1 the rest (a 1-D tensor: sender 1 whole)."""
    sources = []
    for t in manifest.tensors:
        if len(t.shape) == 1:
            sources.append(((1, ((0, t.shape[0]),)),))
            continue
        h, rest = t.shape[0] // 2, tuple((0, d) for d in t.shape[1:])
        sources.append(((0, ((0, h), *rest)), (1, ((h, t.shape[0]), *rest))))
    return Manifest(
        manifest.version, manifest.tensors, manifest.bucket_bytes, 1, 0, 2, tuple(sources)
    )


def _serve(senders, manifest: Manifest, tensors: dict[str, np.ndarray]) -> None:
    for s, sender in enumerate(senders):
        items = []
        for i, t in enumerate(manifest.tensors):
            blocks = [tensors[t.name][tuple(slice(a, b) for a, b in box)]
                      for who, box in manifest.sources[i] if who == s]  # fmt: skip
            items.append((t.name, blocks))
        sender.send(manifest, items)


def test_jax_transfer_equals_gloo_and_a_refusal_keeps_the_last_version(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama", vocab_size=128, with_tokenizer=False)
    _, model = load_hf_checkpoint(path)
    v1 = {k: v * 1.3 for k, v in export_tensors(model).items()}
    v2 = {k: v * 0.7 for k, v in v1.items()}
    shapes = [(n, a.shape) for n, a in v1.items()]
    greedy = m.SamplingParams(max_new_tokens=12, temperature=0.0)
    bcfg = JaxBackendConfig(
        model=str(path), num_slots=4, max_model_len=64, prefill_batch=2, temperature=0.0
    )
    rank = 2  # after the two senders

    async def decode(backend: JaxBackend, tag: str):
        groups = await asyncio.gather(*(
            backend.generate(m.Prompt(f"{tag}{i}", np.asarray(p, np.int32), 1, greedy))
            for i, p in enumerate(PROMPTS)
        ))  # fmt: skip
        return [(list(g[0].token_ids), np.asarray(g[0].logprobs)) for g in groups]

    async def scenario():
        over_gloo, over_transfer = JaxBackend(bcfg), JaxBackend(bcfg)
        await over_gloo.start()
        await over_transfer.start()
        try:
            # gloo: rank 1 of a 2-rank group
            gcfg = GlooTransportConfig(port=0, timeout_s=30.0)
            gsender = make_sender(gcfg, num_receivers=1)
            await over_gloo.connect_transport({"kind": "gloo", "port": gsender.port}, 1, 2)
            manifest = Manifest.of(1, shapes, "float32", 1 << 16)
            thread = threading.Thread(target=gsender.send, args=(manifest, v1.items()))
            thread.start()
            await over_gloo.update_weights(manifest)
            thread.join()
            gsender.close()
            # jax_transfer: two senders, each its own server
            senders = [JaxTransferSender(h, 30.0, s, (rank,), 4) for s, h in enumerate(HOSTS)]
            plane = {"kind": "jax_transfer", "servers": [x.address for x in senders],
                     "group": 4, "timeout_s": 5.0}  # fmt: skip
            await over_transfer.connect_transport(plane, rank, 3)
            fan_in = _two_senders(manifest)
            _serve(senders, fan_in, v1)
            stats = await over_transfer.update_weights(fan_in)
            gloo_out = await decode(over_gloo, "g")
            transfer_out = await decode(over_transfer, "t")
            # version 2, refused: a manifest that does not fit the model (before any pull) ...
            wrong = _two_senders(Manifest.of(2, [(n, (s[0] + 2, *s[1:])) for n, s in shapes],
                                             "float32", 1 << 16))  # fmt: skip
            with pytest.raises(ManifestError):
                await over_transfer.update_weights(wrong)
            # ... and an offer of another manifest than the plan's (the senders serve v2 under
            # another bucket size: same tensors, another fingerprint)
            served = _two_senders(Manifest.of(2, shapes, "float32", 1 << 15))
            _serve(senders, served, v2)
            with pytest.raises(TransferError, match="offered another manifest"):
                await over_transfer.update_weights(
                    _two_senders(Manifest.of(2, shapes, "float32", 1 << 16))
                )
            after = await decode(over_transfer, "a")
            return stats, over_transfer.weight_version, gloo_out, transfer_out, after
        finally:
            await over_gloo.shutdown()
            await over_transfer.shutdown()

    stats, version, gloo_out, transfer_out, after = asyncio.run(scenario())
    assert stats.version == 1 and version == 1
    for (gt, gl), (tt, tl), (at, al) in zip(gloo_out, transfer_out, after, strict=True):
        assert tt == gt and at == gt
        assert len(gl) == len(gt)
        np.testing.assert_allclose(tl, gl, atol=1e-6, rtol=0)
        np.testing.assert_allclose(al, gl, atol=1e-6, rtol=0)
    # the scaled weights changed what the engine decodes: a push of the start weights would
    # not pass as version 1
    start = asyncio.run(_decode_start(bcfg, greedy))
    assert [t for t, _ in start] != [t for t, _ in gloo_out]


async def _decode_start(bcfg: JaxBackendConfig, greedy: m.SamplingParams):
    backend = JaxBackend(bcfg)
    await backend.start()
    try:
        groups = await asyncio.gather(*(
            backend.generate(m.Prompt(f"s{i}", np.asarray(p, np.int32), 1, greedy))
            for i, p in enumerate(PROMPTS)
        ))  # fmt: skip
        return [(list(g[0].token_ids), np.asarray(g[0].logprobs)) for g in groups]
    finally:
        await backend.shutdown()
