"""The publisher's choice of TP sharding: the engines' one TP degree when a
collective transport has `tp_shards` on, whole tensors (TP 1) for mixed degrees, the file
transport or `tp_shards` off; and the sharded manifest's shard kinds for the tiny Llama
(2 KV heads, so TP 4 replicates each KV head on 2 ranks)."""

import pytest

from models.checkpoints.hf_io import load_hf_checkpoint
from trainer.publish import WeightPublisher
from transport.config import FileTransportConfig, GlooTransportConfig, NcclTransportConfig


@pytest.fixture(scope="module")
def cfg(tiny_checkpoint):
    model_cfg, _ = load_hf_checkpoint(tiny_checkpoint("llama", seed=1), dtype="float32")
    return model_cfg


def _publisher(cfg, transport) -> WeightPublisher:
    return WeightPublisher(None, transport, "llama", cfg, "bfloat16")  # type: ignore[arg-type]


def test_shard_degree_follows_the_engines_and_the_transport(cfg, tmp_path):
    gloo = _publisher(cfg, GlooTransportConfig())
    nccl = _publisher(cfg, NcclTransportConfig())
    cases = {
        (("a", 2), ("b", 2)): 2,
        (("a", 4),): 4,
        (("a", 1), ("b", 1)): 1,
        (("a", 2), ("b", 4)): 1,  # mixed degrees: whole tensors to every rank
        (("a", 1), ("b", 2)): 1,  # a JAX engine (TP 1) beside a vLLM TP-2 one
    }
    for members, want in cases.items():
        assert gloo._shard_tp(members) == want, members
        assert nccl._shard_tp(members) == want, members
    off = _publisher(cfg, GlooTransportConfig(tp_shards=False))
    assert off._shard_tp((("a", 2), ("b", 2))) == 1
    file = _publisher(cfg, FileTransportConfig(root=str(tmp_path)))
    assert file._shard_tp((("a", 2), ("b", 2))) == 1


def test_sharded_manifest_kinds_and_kv_replication(cfg):
    pub = _publisher(cfg, GlooTransportConfig())
    m = pub.manifest(3, tp_size=4)
    assert m.tp_size == 4 and m.num_kv_heads == cfg.num_kv_heads == 2
    kinds = {t.name: t.shard for t in m.tensors}
    layer = "model.layers.0"
    assert kinds["model.embed_tokens.weight"] == "vocab"
    assert kinds[f"{layer}.self_attn.q_proj.weight"] == "column"
    assert kinds[f"{layer}.self_attn.k_proj.weight"] == "kv"
    assert kinds[f"{layer}.self_attn.v_proj.weight"] == "kv"
    assert kinds[f"{layer}.self_attn.o_proj.weight"] == "row"
    assert kinds[f"{layer}.mlp.gate_proj.weight"] == "column"
    assert kinds[f"{layer}.mlp.down_proj.weight"] == "row"
    assert kinds[f"{layer}.input_layernorm.weight"] == "replicated"
    assert kinds["model.norm.weight"] == "replicated"
    k = [t.name for t in m.tensors].index(f"{layer}.self_attn.k_proj.weight")
    head_dim = cfg.head_dim
    # TP 4 over 2 KV heads: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    assert [m.region(k, r)[0] for r in range(4)] == [
        slice(0, head_dim),
        slice(0, head_dim),
        slice(head_dim, 2 * head_dim),
        slice(head_dim, 2 * head_dim),
    ]
    assert pub.manifest(3) == pub.manifest(3, tp_size=1) and not pub.manifest(3).sharded
