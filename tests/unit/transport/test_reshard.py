"""Resharding plan: for trainer FSDP meshes of 1, 2, 4, 8 and engine TP 1, 2, 4, each TP rank
receives exactly what vLLM's own loaders take from the full checkpoint tensor."""

import functools
import types
from unittest import mock

import numpy as np
import pytest

from mappings.shards import tp_slice
from tests.unit.transport.reshard_reference import apply_plan, fsdp_rows, plan

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 64, 8, 2, 8, 128, 200
SHAPES = {
    "q": ((HEADS * HEAD_DIM, HIDDEN), "column"),
    "k": ((KV_HEADS * HEAD_DIM, HIDDEN), "kv"),
    "v": ((KV_HEADS * HEAD_DIM, HIDDEN), "kv"),
    "k_bias": ((KV_HEADS * HEAD_DIM,), "kv"),
    "gate": ((INTER, HIDDEN), "column"),
    "up": ((INTER, HIDDEN), "column"),
    "o": ((HIDDEN, HEADS * HEAD_DIM), "row"),
    "down": ((HIDDEN, INTER), "row"),
    "embed": ((VOCAB, HIDDEN), "vocab"),
    "norm": ((HIDDEN,), "replicated"),
}


def _full(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


FULL = {n: _full(s, i) for i, (n, (s, _)) in enumerate(SHAPES.items())}


def _per_rank(name, full, tp, fsdp):
    shape, kind = SHAPES[name]
    shards = np.split(full, fsdp, axis=0)
    pieces = plan(shape, kind, tp, fsdp, num_kv_heads=KV_HEADS)
    return apply_plan(pieces, shards, shape, kind, tp, num_kv_heads=KV_HEADS), pieces


@pytest.mark.parametrize("fsdp", [1, 2, 4, 8])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pieces_tile_each_rank_once(tp, fsdp):
    for name, (shape, kind) in SHAPES.items():
        pieces = plan(shape, kind, tp, fsdp, num_kv_heads=KV_HEADS)
        for r in range(tp):
            region = tp_slice(shape, kind, tp, r, KV_HEADS)
            cover = np.zeros([s.stop - s.start for s in region], dtype=np.int32)
            for p in (p for p in pieces if p.dst == r):
                cover[p.dst_region] += 1
            assert (cover == 1).all(), (name, tp, fsdp, r)
        if kind == "column":  # fan-in: each rank gathers from fsdp/tp shards (at least one)
            assert len(pieces) == tp * max(1, fsdp // tp)


def test_kv_heads_are_replicated_beyond_their_count():
    shape = (KV_HEADS * HEAD_DIM, HIDDEN)
    regions = [tp_slice(shape, "kv", 4, r, KV_HEADS)[0] for r in range(4)]
    assert [(s.start, s.stop) for s in regions] == [(0, 8), (0, 8), (8, 16), (8, 16)]
    assert tp_slice((VOCAB, HIDDEN), "vocab", 4, 3)[0] == slice(192, 200)
    assert fsdp_rows(16, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    with pytest.raises(ValueError, match="not divisible"):
        tp_slice((10, 4), "column", 4, 0)
    with pytest.raises(ValueError, match="needs num_kv_heads"):
        tp_slice(shape, "kv", 2, 0)


@functools.cache
def _vllm_taken(tp: int, rank: int) -> dict[str, np.ndarray]:
    """What vLLM's own loaders keep on TP rank `rank` of `tp` from the full tensors `FULL`
    (layers built with the TP group patched to that rank; vLLM's zero vocab padding rows cut)."""
    import torch
    import vllm.distributed.parallel_state as ps
    import vllm.model_executor.layers.linear as L
    import vllm.model_executor.layers.vocab_parallel_embedding as V
    from vllm.config import VllmConfig, set_current_vllm_config

    group = types.SimpleNamespace(rank_in_group=rank, world_size=tp)
    with (
        set_current_vllm_config(VllmConfig()),
        mock.patch.object(ps, "get_tp_group", return_value=group),
    ):
        f32 = torch.float32
        qkv = L.QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, params_dtype=f32)
        mlp = L.MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False, params_dtype=f32)
        o = L.RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=False, params_dtype=f32)
        down = L.RowParallelLinear(INTER, HIDDEN, bias=False, params_dtype=f32)
        emb = V.VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=f32)
    t = {n: torch.from_numpy(a) for n, a in FULL.items()}
    for sid in ("q", "k", "v"):
        qkv.weight_loader(qkv.weight, t[sid], sid)
    qkv.weight_loader(qkv.bias, t["k_bias"], "k")
    mlp.weight_loader(mlp.weight, t["gate"], 0)
    mlp.weight_loader(mlp.weight, t["up"], 1)
    o.weight_loader(o.weight, t["o"])
    down.weight_loader(down.weight, t["down"])
    emb.weight_loader(emb.weight, t["embed"])
    nq, nkv = qkv.num_heads * HEAD_DIM, qkv.num_kv_heads * HEAD_DIM
    w = qkv.weight.detach().numpy()
    real_rows = tp_slice((VOCAB, HIDDEN), "vocab", tp, rank)[0]
    embed = emb.weight.detach().numpy()
    assert (embed[real_rows.stop - real_rows.start :] == 0).all()  # vLLM's padding rows
    return {
        "q": w[:nq],
        "k": w[nq : nq + nkv],
        "v": w[nq + nkv :],
        "k_bias": qkv.bias.detach().numpy()[nq : nq + nkv],
        "gate": mlp.weight.detach().numpy()[: INTER // tp],
        "up": mlp.weight.detach().numpy()[INTER // tp :],
        "o": o.weight.detach().numpy(),
        "down": down.weight.detach().numpy(),
        "embed": embed[: real_rows.stop - real_rows.start],
        "norm": FULL["norm"],
    }


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_matches_vllm_loaders(tp):
    for fsdp in (1, 2, 4, 8):
        got = {n: _per_rank(n, FULL[n], tp, fsdp)[0] for n in SHAPES}
        for rank in range(tp):
            for n in SHAPES:
                np.testing.assert_array_equal(
                    got[n][rank], _vllm_taken(tp, rank)[n], err_msg=f"{n} tp={tp} r={rank} S={fsdp}"
                )


def _jax_fsdp(full: np.ndarray, fsdp: int, dp: int = 1):
    """`full` (an HF-shaped tensor, which declares no logical axes) as a JAX array on
    `dp * fsdp` host devices: its largest dim divisible by `fsdp` over "fsdp", replicated over
    "dp", so the data plane meets splits of dim 0 and of dim 1 (it reads any layout from the
    array's shards)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from models.sharding import make_mesh

    mesh = make_mesh(dp=dp, fsdp=fsdp, devices=jax.devices()[: dp * fsdp])
    dims = [d for d in range(full.ndim) if full.shape[d] % fsdp == 0]
    dim = max(dims, key=lambda d: full.shape[d]) if fsdp > 1 and dims else None
    spec = PartitionSpec(*["fsdp" if d == dim else None for d in range(full.ndim)])
    return jax.device_put(full, NamedSharding(mesh, spec))


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("fsdp", "dp", "tp", "engines", "dtype"),
    [(f, 1, t, 1, "float32") for f in (1, 2, 4, 8) for t in (1, 2, 4)]
    + [(4, 2, 2, 2, "float32"), (8, 1, 4, 1, "bfloat16")],
)
def test_gloo_delivers_each_rank_only_what_vllm_takes(fsdp, dp, tp, engines, dtype):
    """The real gloo transport, sharded manifest: the sender reads FSDP-sharded JAX arrays
    (fan-in / fan-out through `reshard.pieces_for`); each of `engines` engines' TP ranks gets
    exactly what vLLM's loaders keep for it, and only that (the bytes it was sent)."""
    import threading

    import torch

    from transport.config import GlooTransportConfig
    from transport.factory import make_receiver, make_sender
    from transport.manifest import Manifest

    arrays = {n: _jax_fsdp(FULL[n], fsdp, dp) for n in SHAPES}
    if fsdp > 1:
        assert len({str(s.index) for s in arrays["k"].addressable_shards}) == fsdp
        assert arrays["down"].sharding.spec[1] == "fsdp"  # a dim-1 split too
    base = Manifest.of(3, [(n, SHAPES[n][0]) for n in SHAPES], dtype, bucket_bytes=40_000)
    m = base.sharded_for(tp, {n: k for n, (_, k) in SHAPES.items()}, num_kv_heads=KV_HEADS)
    assert len(m.buckets()) > 2
    cfg = GlooTransportConfig(port=0, timeout_s=30)
    world = 1 + engines * tp
    sender = make_sender(cfg, num_receivers=world - 1)
    cfg = cfg.model_copy(update={"port": sender.port})
    receivers = [make_receiver(cfg, rank=g, world_size=world) for g in range(1, world)]
    got: list[dict[str, torch.Tensor]] = [{} for _ in receivers]
    received = [0] * len(receivers)
    errors: list[BaseException] = []

    def receive(j: int) -> None:
        def on_bucket(bucket):
            for name, t in bucket:
                got[j][name] = t.clone()
                received[j] += t.numel() * t.element_size()

        try:
            receivers[j].receive(m, on_bucket)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            errors.append(e)

    threads = [threading.Thread(target=receive, args=(j,)) for j in range(len(receivers))]
    for t in threads:
        t.start()
    stats = sender.send(m, ((n, arrays[n]) for n in SHAPES))
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert stats.version == 3 and stats.num_buckets == len(m.buckets())
    full_bytes = m.total_bytes
    for j, per_name in enumerate(got):
        rank = j % tp
        taken = _vllm_taken(tp, rank)
        for n in SHAPES:
            ref = torch.from_numpy(taken[n]).to(getattr(torch, dtype))
            assert torch.equal(per_name[n], ref), (n, fsdp, dp, tp, rank)
        if tp > 1:  # only its shards and the norm travelled to this rank
            assert received[j] < full_bytes * (1 / tp + 0.25), (received[j], full_bytes)
