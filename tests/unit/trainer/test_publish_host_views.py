"""What `WeightPublisher` hands the packer: a param held on one CPU device arrives as a strided
view of its own fp32 buffer (no cast, no transposed copy; the packing copy does both), a param
split over devices arrives cast to bf16 in JAX; for a whole manifest and for a TP-2 sharded one
both pack into byte-identical buffers, equal to the checkpoint rounded to bf16 by JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from models.checkpoints.hf_io import load_hf_checkpoint
from models.params import flat_params
from models.sharding import make_mesh
from trainer.publish import WeightPublisher
from transport.base import iter_packed
from transport.config import GlooTransportConfig
from transport.sharded import iter_packed_sharded

BUCKET = 48 * 1024  # several buckets for the tiny llama (about 0.3 MB in bf16)
Q = "model.layers.0.self_attn.q_proj.weight"  # transposed by the mapping: "D N H" -> "(N H) D"


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=5)


def _publisher(cfg) -> WeightPublisher:
    transport = GlooTransportConfig(bucket_bytes=BUCKET)
    return WeightPublisher(None, transport, "llama", cfg, "bfloat16")  # type: ignore[arg-type]


def _packed(publisher: WeightPublisher, params) -> list[bytes]:
    manifest = publisher.manifest(1)
    return [bytes(b.numpy()) for b in iter_packed(manifest, publisher._engine_tensors(params))]


def _expected(publisher: WeightPublisher, path) -> list[bytes]:
    """The checkpoint's tensors rounded to bf16 by JAX, packed in manifest order."""
    reference = load_file(str(path / "model.safetensors"))
    manifest = publisher.manifest(1)

    def jax_bf16():
        for spec in manifest.tensors:
            x = jnp.asarray(reference[spec.name].numpy()).astype(jnp.bfloat16)
            yield spec.name, np.asarray(x)

    return [bytes(b.numpy()) for b in iter_packed(manifest, jax_bf16())]


def test_host_params_come_as_uncast_views_and_pack_to_jax_rounding(path):
    cfg, decoder = load_hf_checkpoint(path, dtype="float32")
    params = flat_params(decoder)
    publisher = _publisher(cfg)
    tensors = dict(publisher._engine_tensors(params))
    q = tensors[Q]
    assert q.dtype == np.float32 and q.shape == (128, 64)
    assert not q.flags.c_contiguous  # the transpose is a view ...
    assert np.shares_memory(q, np.asarray(params["layers.0.attn.q.kernel"]))  # ... of the param
    expected = _expected(publisher, path)
    got = _packed(publisher, params)
    assert len(got) == len(publisher.manifest(1).buckets()) == len(expected) > 1
    assert got == expected


def test_params_split_over_devices_are_cast_in_jax_and_pack_the_same(path):
    mesh = make_mesh(fsdp=2, devices=jax.devices()[:2])
    cfg, decoder = load_hf_checkpoint(path, dtype="float32", mesh=mesh, min_shard_bytes=0)
    params = flat_params(decoder)
    assert len(params["layers.0.attn.q.kernel"].sharding.device_set) == 2
    publisher = _publisher(cfg)
    q = dict(publisher._engine_tensors(params))[Q]
    assert q.dtype == jnp.bfloat16 and q.shape == (128, 64)
    assert _packed(publisher, params) == _expected(publisher, path)
    whole = torch.from_numpy(np.ascontiguousarray(q).view(np.uint16)).view(torch.bfloat16)
    reference = load_file(str(path / "model.safetensors"))[Q].to(torch.bfloat16)
    assert torch.equal(whole, reference)


def _packed_tp2(publisher: WeightPublisher, tensors) -> list[tuple[bytes, bytes, bytes]]:
    """Each bucket of the TP-2 sharded manifest as (replicated, rank 0, rank 1) bytes."""
    manifest = publisher.manifest(1, tp_size=2)
    out = []
    for b in iter_packed_sharded(manifest, tensors, [0, 1]):
        rep = b"" if b.replicated is None else bytes(b.replicated.numpy())
        ranks = [bytes(b.per_rank[r].numpy()) if b.per_rank else b"" for r in (0, 1)]
        out.append((rep, ranks[0], ranks[1]))
    return out


def test_sharded_manifest_packs_host_views_and_split_params_alike(path):
    """TP 2: each rank's regions copied out of uncast host views equal those copied out of
    bf16 FSDP shards, and those of the checkpoint rounded to bf16 by JAX."""
    cfg, decoder = load_hf_checkpoint(path, dtype="float32")
    host = flat_params(decoder)
    mesh = make_mesh(fsdp=2, devices=jax.devices()[:2])
    _, split_decoder = load_hf_checkpoint(path, dtype="float32", mesh=mesh, min_shard_bytes=0)
    split = flat_params(split_decoder)
    publisher = _publisher(cfg)
    q = dict(publisher._sharded_tensors(host))[Q]
    assert q.dtype == np.float32 and not q.flags.c_contiguous
    assert isinstance(dict(publisher._sharded_tensors(split))[Q], jax.Array)
    manifest = publisher.manifest(1, tp_size=2)
    expected = _expected_tp2(publisher, path, manifest)
    got_host = _packed_tp2(publisher, publisher._sharded_tensors(host))
    got_split = _packed_tp2(publisher, publisher._sharded_tensors(split))
    assert len(expected) == len(manifest.buckets()) > 1
    assert got_host == expected
    assert got_split == expected
    assert manifest.tensors[3].name == Q  # rank 1 got only rows 64..128 of q_proj
    assert manifest.region(3, 1) == (slice(64, 128), slice(0, 64))


def _expected_tp2(publisher, path, manifest) -> list:
    """The TP-2 packing of `manifest`'s tensors as the checkpoint holds them, rounded to bf16
    by JAX."""
    reference = load_file(str(path / "model.safetensors"))
    return _packed_tp2(
        publisher,
        (
            (t.name, np.asarray(jnp.asarray(reference[t.name].numpy()).astype(jnp.bfloat16)))
            for t in manifest.tensors
        ),
    )


def test_params_of_a_tp2_trainer_pack_like_the_checkpoint(path):
    """The trainer's params on a ("dp", "fsdp", "tp") = (1, 2, 2) mesh (q split by head over
    tp and by model width over fsdp): the whole manifest (an engine at TP 1) and the TP-2
    sharded one pack byte for byte like the checkpoint rounded to bf16 by JAX."""
    mesh = make_mesh(1, 2, devices=jax.devices()[:4], tp=2)
    cfg, decoder = load_hf_checkpoint(path, dtype="float32", mesh=mesh, min_shard_bytes=0)
    params = flat_params(decoder)
    assert tuple(params["layers.0.attn.q.kernel"].sharding.spec) == ("fsdp", "tp", None)
    assert tuple(params["layers.0.attn.o.kernel"].sharding.spec) == ("tp", None, "fsdp")
    publisher = _publisher(cfg)
    assert _packed(publisher, params) == _expected(publisher, path)
    manifest = publisher.manifest(1, tp_size=2)
    expected = _expected_tp2(publisher, path, manifest)
    assert _packed_tp2(publisher, publisher._sharded_tensors(params)) == expected


@pytest.mark.parametrize(("variant", "tp"), [("qwen3_moe", 2), ("olmoe", 1)])
def test_params_of_an_expert_parallel_trainer_pack_like_the_checkpoint(
    variant, tp, tiny_checkpoint
):
    """The trainer's params on a ("dp", "fsdp", "ep", "tp") = (1, 2, 2, tp) mesh (the stacked
    experts split over ep, their width over fsdp, their MLP width over tp; the tiny OLMoE has
    one KV head, so tp 1): the whole manifest packs byte for byte like the checkpoint rounded
    to bf16 by JAX, every expert's tensors included."""
    moe_path = tiny_checkpoint(variant, seed=3)
    mesh = make_mesh(1, 2, devices=jax.devices()[: 4 * tp], tp=tp, ep=2)
    cfg, decoder = load_hf_checkpoint(moe_path, dtype="float32", mesh=mesh, min_shard_bytes=0)
    params = flat_params(decoder)
    gate = params["layers.0.mlp.experts.gate.kernel"]
    spec = tuple(gate.sharding.spec) + (None,) * (3 - len(gate.sharding.spec))
    assert spec == ("ep", "fsdp", "tp" if tp > 1 else None)
    assert gate.addressable_shards[0].data.shape[0] == cfg.num_experts // 2
    publisher = WeightPublisher(
        None, GlooTransportConfig(bucket_bytes=BUCKET), variant, cfg, "bfloat16"
    )  # type: ignore[arg-type]
    names = [t.name for t in publisher.manifest(1).tensors]
    last = cfg.num_experts - 1
    assert any(f"experts.{last}." in n for n in names)  # per-expert tensors, the last included
    assert _packed(publisher, params) == _expected(publisher, moe_path)
