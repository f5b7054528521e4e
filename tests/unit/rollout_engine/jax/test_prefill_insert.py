"""Prefill buckets and exactness; slot substitution, plain and sharded (no collectives)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.checkpoints.tiny import TINY_CONFIGS
from models.config import ModelConfig
from models.decoder import Decoder
from rollout_engine.jax.insert import make_insert
from rollout_engine.jax.prefill import Prefiller, length_bucket, next_pow2
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.state import init_slots
from rollout_engine.jax.stops import StopConfig


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.from_hf(dict(TINY_CONFIGS["llama"], vocab_size=64, eos_token_id=0))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    return cfg, model, graphdef, params


def test_next_pow2() -> None:
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 17)] == [1, 2, 4, 4, 8, 32]
    assert next_pow2(3, minimum=16) == 16


def test_length_buckets_are_four_per_doubling() -> None:
    """16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, ...: each the smallest such value
    holding n (and >= minimum); past 32 a bucket never pads more than a fifth of itself."""
    assert [length_bucket(n, 16) for n in (1, 16, 17, 24, 25, 33, 49, 65, 100, 158, 257)] == [
        16, 16, 24, 24, 32, 40, 56, 80, 112, 160, 320,
    ]  # fmt: skip
    assert length_bucket(20, 32) == 32  # the minimum is itself the smallest bucket
    assert len({length_bucket(n, 16) for n in range(129, 257)}) == 4  # 160, 192, 224, 256
    for n in range(17, 2000):
        b = length_bucket(n, 16)
        assert b >= n and (b - n) <= b // 3, n
        assert n <= 32 or 5 * (b - n) <= b, n


def test_prefill_is_compiled_once_per_bucket_and_exact(tiny) -> None:
    cfg, model, graphdef, params = tiny
    pre = Prefiller(graphdef, cfg, pad_id=1, min_len=8, max_len=64, batch=3)
    prompts = [tuple(range(2, 5)), tuple(range(5, 22)), tuple(range(1, 21))]
    out = pre(params, prompts)
    assert pre.buckets == [(4, 24)]  # 20 tokens: the bucket 24 (`length_bucket`)
    pre(params, [(7, 8, 9)])  # T bucket 8
    pre(params, [tuple(range(3, 26))])  # 23 tokens, T bucket 24 again: no new compilation
    assert pre.buckets == [(4, 8), (4, 24)]
    np.testing.assert_array_equal(out.lengths, [3, 17, 20, 1])
    for i, p in enumerate(prompts):
        seq = jnp.asarray([p], jnp.int32)
        logits, _ = model(seq, jnp.arange(len(p), dtype=jnp.int32)[None])
        np.testing.assert_allclose(out.last_logits[i], logits[0, -1], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="1 to 3 prompts, got 4"):
        pre(params, [(1,)] * 4)
    with pytest.raises(ValueError, match="more than max_len=64"):
        pre(params, [tuple(range(65))])


def _state_and_prefill(tiny, slots, sharding=None):
    cfg, _, graphdef, params = tiny
    state = init_slots(cfg, num_slots=slots, max_len=32, capacity=16, marker_len=1, pad_id=1)
    if sharding is not None:
        state = jax.device_put(state, sharding)
    pre = Prefiller(graphdef, cfg, pad_id=1, min_len=8, max_len=32, batch=2)(
        params, [(3, 4, 5), (6, 7, 8, 9, 10)]
    )
    return state, pre


def _insert_args(slots):
    n = slots
    idx = np.full(n, n, np.int32)
    idx[:3] = [5, 0, 6]
    rows = np.zeros(n, np.int32)
    rows[:3] = [1, 0, 1]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), n)))
    max_new = np.full(n, 4, np.int32)
    return idx, rows, keys, max_new


def test_sharded_substitution_matches_plain_and_moves_nothing(tiny) -> None:
    slots = 8
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    sampling, stops = SamplingConfig(temperature=1.0), StopConfig(eos_ids=(0,), pad_id=1)
    kw = dict(capacity=16, marker_len=1, sampling=sampling, stops=stops)
    args = _insert_args(slots)

    state, pre = _state_and_prefill(tiny, slots)
    plain = make_insert(**kw)(state, pre, *args)

    sharded_fn = make_insert(**kw, mesh=mesh)
    state, pre = _state_and_prefill(tiny, slots, NamedSharding(mesh, P("data")))
    pre = jax.device_put(pre, NamedSharding(mesh, P()))
    hlo = sharded_fn.lower(state, pre, *args).compile().as_text()
    for collective in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
        assert collective not in hlo, f"the sharded substitution has an {collective}"
    sharded = sharded_fn(state, pre, *args)

    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(sharded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(plain.active, [1, 0, 0, 0, 0, 1, 1, 0])
    np.testing.assert_array_equal(plain.pos, [3, 0, 0, 0, 0, 5, 5, 0])
    np.testing.assert_array_equal(plain.gen_len, [1, 0, 0, 0, 0, 1, 1, 0])
    # slot 5 took prompt row 1: its first 8 cache positions are that row of the prefill
    np.testing.assert_array_equal(plain.cache.k[0][5, :, :8], pre.cache.k[0][1])
    np.testing.assert_array_equal(plain.cache.k[0][1], np.zeros_like(plain.cache.k[0][1]))
