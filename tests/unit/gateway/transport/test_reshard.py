"""Resharding plan: for trainer FSDP meshes of 1, 2, 4, 8 and engine TP 1, 2, 4, each TP rank
receives exactly what vLLM's own loaders take from the full checkpoint tensor."""

import types
from unittest import mock

import numpy as np
import pytest

from gateway.transport.reshard import apply_plan, fsdp_rows, plan, tp_slice

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


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_matches_vllm_loaders(tp):
    import torch
    import vllm.distributed.parallel_state as ps
    import vllm.model_executor.layers.linear as L
    import vllm.model_executor.layers.vocab_parallel_embedding as V
    from vllm.config import VllmConfig, set_current_vllm_config

    full = {n: _full(s, i) for i, (n, (s, _)) in enumerate(SHAPES.items())}
    got = {}
    for fsdp in (1, 2, 4, 8):
        got[fsdp] = {n: _per_rank(n, full[n], tp, fsdp)[0] for n in SHAPES}
    for rank in range(tp):
        group = types.SimpleNamespace(rank_in_group=rank, world_size=tp)
        with (
            set_current_vllm_config(VllmConfig()),
            mock.patch.object(ps, "get_tp_group", return_value=group),
        ):
            f32 = torch.float32
            qkv = L.QKVParallelLinear(
                HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, params_dtype=f32
            )
            mlp = L.MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False, params_dtype=f32)
            o = L.RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=False, params_dtype=f32)
            down = L.RowParallelLinear(INTER, HIDDEN, bias=False, params_dtype=f32)
            emb = V.VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=f32)
        t = {n: torch.from_numpy(a) for n, a in full.items()}
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
        taken = {
            "q": w[:nq],
            "k": w[nq : nq + nkv],
            "v": w[nq + nkv :],
            "k_bias": qkv.bias.detach().numpy()[nq : nq + nkv],
            "gate": mlp.weight.detach().numpy()[: INTER // tp],
            "up": mlp.weight.detach().numpy()[INTER // tp :],
            "o": o.weight.detach().numpy(),
            "down": down.weight.detach().numpy(),
            "embed": emb.weight.detach().numpy(),
            "norm": full["norm"],
        }
        for fsdp in (1, 2, 4, 8):
            for n in SHAPES:
                mine = got[fsdp][n][rank]
                ref = taken[n]
                if n == "embed":  # vLLM pads the vocab shard with zero rows
                    assert (ref[len(mine) :] == 0).all()
                    ref = ref[: len(mine)]
                np.testing.assert_array_equal(mine, ref, err_msg=f"{n} tp={tp} r={rank} S={fsdp}")
