"""A JAX engine replica with tensor parallelism (`rollout_engine.jax.tp`) on the 8 CPU devices:
tp = 2 and tp = 2 x data = 2 give the one-device engine's greedy tokens (exact ids) and
log-probs within 1e-5 (fp32) on the tiny llama and qwen3 families, with the params and the KV
cache really split by the rules table, before and after a weight push; so do a model with fewer
KV heads than tp (2 KV heads at tp 4, and 1 KV head with biases at tp 2), its KV heads
replicated; a model whose heads "tp" can neither split nor replicate is refused before any
replica starts."""

import asyncio
import threading

import jax
import numpy as np
import pydantic
import pytest
from flax import nnx

from gateway import messages as m
from mappings.apply import checkpoint_to_params
from mappings.registry import get_family
from models.checkpoints.hf_io import export_tensors, load_hf_checkpoint
from models.checkpoints.tiny import TINY_CONFIGS, make_tiny_checkpoint
from models.config import ModelConfig
from models.decoder import Decoder
from models.params import model_from_params
from models.sharding import MeshError
from rollout_engine.config import JaxOptions
from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig
from rollout_engine.jax.batcher import BatcherConfig
from rollout_engine.jax.engine import EngineConfig, JaxEngine
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request
from transport.file import FileSender
from transport.manifest import Manifest

EOS = 0
# (devices per replica, tp): one device, tp = 2, tp = 2 x data = 2
LAYOUTS = [(1, 1), (2, 2), (4, 2)]


def _model(family: str, seed: int = 0):
    cfg = ModelConfig.from_hf(dict(TINY_CONFIGS[family], vocab_size=64, eos_token_id=EOS))
    return cfg, nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed)))[1]


def _requests(tag: str) -> list[Request]:
    rng = np.random.default_rng(0)
    return [
        Request(
            f"{tag}{i}",
            tuple(int(t) for t in rng.integers(1, 64, size=int(rng.integers(2, 20)))),
            num_samples=2,
            max_new_tokens=12,
        )
        for i in range(4)
    ]


def _engine(cfg, params, d: int, tp: int) -> JaxEngine:
    ecfg = EngineConfig(
        BatcherConfig(num_slots=4, max_len=48, prefill_batch=2, steps_per_call=4),
        SamplingConfig(temperature=0.0),
        StopConfig(eos_ids=(EOS,), pad_id=1),
        devices_per_replica=d,
        tp=tp,
    )
    return JaxEngine(cfg, params, ecfg)


def _assert_sharded(engine: JaxEngine, cfg: ModelConfig, tp: int) -> None:
    """q's kernel [D, N, H] split over "tp" on the heads; the KV cache [B, K, S, H] on K."""
    batcher = engine.replicas[0]
    q = batcher.params["layers"][0]["attn"]["q"]["kernel"].get_value()
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
    shard_shapes = {s.data.shape for s in q.addressable_shards}
    assert shard_shapes == {(cfg.hidden_size, cfg.num_heads // tp, cfg.head_dim)}
    k = batcher.state.cache.k[0]
    data = batcher.mesh.shape["data"]
    assert {s.data.shape for s in k.addressable_shards} == {
        (4 // data, max(cfg.num_kv_heads, tp) // tp, 48, cfg.head_dim)
    }


def _same(ref, got) -> None:
    for a, b in zip(ref, got, strict=True):
        assert (a.prompt_id, a.sample_index) == (b.prompt_id, b.sample_index)
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tp_replica_equals_one_device_before_and_after_a_push(family: str) -> None:
    cfg, params = _model(family)
    _, pushed = _model(family, seed=1)
    host = jax.tree.map(np.asarray, pushed)  # what a transport's host arrays give
    runs = []
    for d, tp in LAYOUTS:
        with _engine(cfg, params, d, tp) as engine:
            before = engine.generate(_requests("a"))
            if tp > 1:
                _assert_sharded(engine, cfg, tp)
            engine.update_weights(host, version=1)
            after = engine.generate(_requests("b"))
            assert {v for r in after for v, _, _ in r.weight_versions} == {1}
            if tp > 1:
                _assert_sharded(engine, cfg, tp)
        runs.append((before, after))
    (ref_before, ref_after), *rest = runs
    assert [r.tokens.tolist() for r in ref_before] != [r.tokens.tolist() for r in ref_after]
    for before, after in rest:
        _same(ref_before, before)
        _same(ref_after, after)


def _assert_kv_replicated(engine: JaxEngine, cfg: ModelConfig, params, tp: int) -> None:
    """Each tp rank holds the k kernel [D, 1, H] of KV head n // (N / K) for its query heads n
    (the model's head, repeated), and its own KV cache of one head [B / data, 1, S, H]."""
    batcher = engine.replicas[0]
    k = batcher.params["layers"][0]["attn"]["k"]["kernel"].get_value()
    src = np.asarray(params["layers"][0]["attn"]["k"]["kernel"].get_value())  # [D, K, H]
    assert k.shape == (cfg.hidden_size, tp, cfg.head_dim)
    assert k.sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
    per_rank = cfg.num_heads // tp  # query heads on one tp rank
    for shard in k.addressable_shards:
        rank = shard.index[1].start  # this shard's KV head = its tp rank
        head = rank * per_rank // (cfg.num_heads // cfg.num_kv_heads)
        np.testing.assert_array_equal(np.asarray(shard.data), src[:, head : head + 1])
    cache = batcher.state.cache.k[0]
    data = batcher.mesh.shape["data"]
    assert cache.shape[1] == tp
    assert {s.data.shape for s in cache.addressable_shards} == {(4 // data, 1, 48, cfg.head_dim)}


# (family, devices per replica, tp): KV heads K < tp, so each is held tp / K times
REPLICATED = [("llama", 4, 4), ("llama_bias", 2, 2)]  # K = 2 at tp 4; K = 1 (biases) at tp 2


@pytest.mark.parametrize(("family", "d", "tp"), REPLICATED)
def test_kv_heads_replicated_equal_one_device_before_and_after_a_push(family, d, tp) -> None:
    cfg, params = _model(family)
    assert cfg.num_kv_heads < tp
    _, pushed = _model(family, seed=1)
    runs = []
    for dd, tt in ((1, 1), (d, tp)):
        with _engine(cfg, params, dd, tt) as engine:
            before = engine.generate(_requests("a"))
            if tt > 1:
                _assert_kv_replicated(engine, cfg, params, tt)
            # host arrays for llama, jax arrays on one device (repeated there) for llama_bias
            new = jax.tree.map(np.asarray, pushed) if family == "llama" else pushed
            engine.update_weights(new, version=1)
            after = engine.generate(_requests("b"))
            assert {v for r in after for v, _, _ in r.weight_versions} == {1}
            if tt > 1:
                _assert_kv_replicated(engine, cfg, pushed, tt)
        runs.append((before, after))
    (ref_before, ref_after), (got_before, got_after) = runs
    assert [r.tokens.tolist() for r in ref_before] != [r.tokens.tolist() for r in ref_after]
    _same(ref_before, got_before)
    _same(ref_after, got_after)


def test_kv_replicated_push_of_wrong_kv_heads_is_refused_and_keeps_serving() -> None:
    """A pushed k kernel with neither the model's K nor the replica's tp KV heads is refused
    by name; the version served before stays served."""
    cfg, params = _model("llama_bias")  # K = 1
    with _engine(cfg, params, 2, 2) as engine:
        before = engine.generate(_requests("a"))
        bad = jax.tree.map(np.asarray, params)
        kernel = bad["layers"][1]["attn"]["v"]["kernel"]
        kernel.set_value(np.zeros((cfg.hidden_size, 3, cfg.head_dim), np.float32))
        with pytest.raises(ValueError, match=r"layers\.1\.attn\.v\.kernel .* has 3 KV heads"):
            engine.update_weights(bad, version=1)
        again = engine.generate(_requests("a"))
        assert {v for r in again for v, _, _ in r.weight_versions} == {0}
        _same(before, again)


def _cfg(**kw) -> ModelConfig:
    return ModelConfig.from_hf(dict(TINY_CONFIGS["llama"], vocab_size=64, eos_token_id=EOS, **kw))


@pytest.mark.parametrize(
    ("kw", "tp", "message"),
    [
        # K < tp with K not dividing tp: 6 query heads, 2 KV heads at tp 3
        (dict(num_attention_heads=6, num_key_value_heads=2), 3, "jax tp=3 is not a multiple"),
        # query heads tp does not divide (KV heads would replicate): 4 heads at tp 8
        ({}, 8, "jax tp=8 does not divide the model's num_heads=4"),
        # K >= tp with tp not dividing K: 12 heads, 6 KV heads at tp 4
        (dict(num_attention_heads=12, num_key_value_heads=6), 4, "num_kv_heads=6"),
    ],
)
def test_heads_that_neither_split_nor_replicate_are_refused(kw, tp, message) -> None:
    from rollout_engine.jax.tp import check_replica_tp

    with pytest.raises(MeshError, match=message):
        check_replica_tp(_cfg(**kw), tp)


def test_kv_replication_with_one_norm_over_the_key_projection_is_refused() -> None:
    from rollout_engine.jax.tp import check_replica_tp

    olmoe = ModelConfig.from_hf(dict(TINY_CONFIGS["olmoe"], vocab_size=64, eos_token_id=EOS))
    assert (olmoe.qk_norm_full, olmoe.num_heads, olmoe.num_kv_heads) == (True, 2, 1)
    with pytest.raises(MeshError, match="qk_norm_full"):
        check_replica_tp(olmoe, 2)


def test_heads_tp_does_not_divide_are_refused_before_start() -> None:
    cfg, params = _model("llama")  # 4 query heads, 2 KV heads
    with pytest.raises(MeshError, match="jax tp=8 does not divide the model's num_heads=4"):
        _engine(cfg, params, 8, 8)
    with pytest.raises(ValueError, match="jax tp=3 does not divide the replica's 4 devices"):
        _engine(cfg, params, 4, 3)
    odd = ModelConfig.from_hf(dict(TINY_CONFIGS["llama"], vocab_size=63, eos_token_id=EOS))
    odd_params = nnx.split(Decoder(odd, rngs=nnx.Rngs(0)))[1]
    with pytest.raises(ValueError, match="logical axis 'vocab' of size 63 does not split over"):
        _engine(odd, odd_params, 2, 2)
    with pytest.raises(pydantic.ValidationError, match="tp=3 does not divide devices_per_rep"):
        JaxOptions(devices_per_replica=4, tp=3)  # the engine process's flags, at parse time


def _one_device(cfg, model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and log-probs of `prompt` on one device (the reference), stopping where
    the backend does (the model's EOS ids, pad the first)."""
    eos = tuple(cfg.eos_token_ids)
    ecfg = EngineConfig(
        BatcherConfig(num_slots=1, max_len=64),
        SamplingConfig(temperature=0.0),
        StopConfig(eos_ids=eos, pad_id=eos[0]),
    )
    with JaxEngine(cfg, nnx.split(model)[1], ecfg) as engine:
        r = engine.generate([Request("r", tuple(prompt), 1, 12)])[0]
    return r.tokens.tolist(), r.logprobs


@pytest.mark.parametrize("tp", [2, 4])  # 4: the tiny llama's 2 KV heads replicated
def test_backend_push_lands_in_the_tp_layout(tmp_path, tp: int) -> None:
    """A pushed version through the file data plane lands split by the rules (host arrays put
    straight into the replica's layout, KV heads repeated at tp 4) and serves the one-device
    engine's greedy output."""
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama", vocab_size=128, with_tokenizer=False)
    cfg, model = load_hf_checkpoint(path)
    scaled = {k: v * 1.3 for k, v in export_tensors(model).items()}
    prompt = [5, 9, 30, 41]
    greedy = m.SamplingParams(max_new_tokens=12, temperature=0.0)
    bcfg = JaxBackendConfig(
        model=str(path), num_slots=4, max_model_len=64, prefill_batch=2, temperature=0.0,
        devices_per_replica=4, tp=tp,
    )  # fmt: skip

    async def scenario():
        backend = JaxBackend(bcfg)
        await backend.start()
        try:
            p = m.Prompt("a", np.asarray(prompt, np.int32), 1, greedy)
            before = await backend.generate(p)
            await backend.connect_transport({"kind": "file", "root": str(tmp_path / "plane")})
            manifest = Manifest.of(1, [(n, a.shape) for n, a in scaled.items()], "float32", 1 << 16)
            sender = FileSender(tmp_path / "plane")
            thread = threading.Thread(target=sender.send, args=(manifest, scaled.items()))
            thread.start()
            await backend.update_weights(manifest)
            thread.join()
            after = await backend.generate(m.Prompt("b", np.asarray(prompt, np.int32), 1, greedy))
            assert backend.engine is not None
            _assert_sharded_backend(backend.engine, cfg, tp)
            return before[0], after[0]
        finally:
            await backend.shutdown()

    before, after = asyncio.run(scenario())
    loaded = {
        r.jax: a
        for r, a in checkpoint_to_params(
            get_family(cfg.family), cfg, scaled.__getitem__, set(scaled)
        )
    }
    for got, ref_model in ((before, model), (after, model_from_params(cfg, loaded))):
        tokens, logprobs = _one_device(cfg, ref_model, prompt)
        assert list(got.token_ids) == tokens
        np.testing.assert_allclose(got.logprobs, logprobs, rtol=0, atol=1e-5)
    assert after.version_spans[0][0] == 1


def _assert_sharded_backend(engine: JaxEngine, cfg: ModelConfig, tp: int) -> None:
    batcher = engine.replicas[0]
    while batcher.version != 1:  # the switch happens at the replica's next safe point
        engine.poll(0.05)
    down = batcher.params["layers"][0]["mlp"]["down"]["kernel"].get_value()  # [F, D], row-par.
    assert down.sharding.spec == jax.sharding.PartitionSpec("tp", None)
    assert {s.data.shape for s in down.addressable_shards} == {
        (cfg.intermediate_size // tp, cfg.hidden_size)
    }
    v = batcher.params["layers"][1]["attn"]["v"]["kernel"].get_value()  # [D, max(K, tp), H]
    assert v.shape == (cfg.hidden_size, max(cfg.num_kv_heads, tp), cfg.head_dim)
    assert {s.data.shape for s in v.addressable_shards} == {
        (cfg.hidden_size, max(cfg.num_kv_heads, tp) // tp, cfg.head_dim)
    }
