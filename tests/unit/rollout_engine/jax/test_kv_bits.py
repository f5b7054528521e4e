"""A bfloat16 KV cache held as its uint16 bit patterns (`BatcherConfig.kv_bits`) gives the
bfloat16 cache's tokens and log-probs exactly, through prefill, decode and a continuation
(XLA's attention on both; the native kernel over the bits, `native_attention`, is held to
the same tokens below)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.decoder import Decoder
from models.kv_cache import KVCache, from_storage, storage_dtype, to_storage
from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request


@pytest.fixture(scope="module")
def tiny_bf16(tiny_split):
    cfg, _, params = tiny_split("llama")
    cfg = cfg.replace(dtype="bfloat16")  # bf16 compute and KV, fp32 residual stream
    graphdef, _ = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    return cfg, graphdef, params


def _requests():
    rng = np.random.default_rng(3)
    return [
        Request(i, tuple(int(t) for t in rng.integers(1, 64, size=int(n))), 2, 20)
        for i, n in enumerate((5, 17, 30, 9))
    ]


def _run(tiny, kv_bits, sampling, native_attention=False):
    cfg, graphdef, params = tiny
    bcfg = BatcherConfig(num_slots=4, max_len=64, prefill_batch=2, kv_bits=kv_bits,
                         native_attention=native_attention)  # fmt: skip
    b = ContinuousBatcher(cfg, graphdef, params, bcfg, sampling, StopConfig((0,), 1))
    b.submit(_requests())
    res = sorted(b.run_until_idle(), key=lambda r: (r.prompt_id, r.sample_index))
    return b, res


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bits_cache_gives_the_bf16_cache_tokens_and_logprobs_exactly(tiny_bf16, temperature):
    sampling = SamplingConfig(temperature=temperature)
    b_bits, bits = _run(tiny_bf16, True, sampling)
    b_bf16, bf16 = _run(tiny_bf16, False, sampling)
    assert b_bits.state.cache.k[0].dtype == jnp.uint16
    assert b_bf16.state.cache.k[0].dtype == jnp.bfloat16
    assert len(bits) == len(bf16) == 8
    assert sum(len(r.tokens) for r in bits) > 40  # decode ran, not only the first token
    for x, y in zip(bits, bf16, strict=True):
        assert (x.prompt_id, x.sample_index) == (y.prompt_id, y.sample_index)
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)  # bit for bit
    # the cache itself holds the same bfloat16 values, bit for bit
    for kb, kf in zip(b_bits.state.cache.k, b_bf16.state.cache.k, strict=True):
        np.testing.assert_array_equal(
            np.asarray(kb), np.asarray(jax.lax.bitcast_convert_type(kf, jnp.uint16))
        )


def test_default_is_bits_on_cpu_and_a_float32_model_ignores_it(tiny_bf16, tiny_split):
    b, _ = _run(tiny_bf16, None, SamplingConfig(temperature=0.0))
    assert jax.devices()[0].platform == "cpu"
    assert b.state.cache.k[0].dtype == jnp.uint16
    b32, _ = _run(tiny_split("llama"), True, SamplingConfig(temperature=0.0))
    assert b32.state.cache.k[0].dtype == jnp.float32


def test_storage_round_trip_is_exact_and_other_dtypes_pass_through(tiny_bf16):
    cfg = tiny_bf16[0]
    x = jax.random.normal(jax.random.key(0), (2, 3, 4), jnp.float32)
    bits = KVCache.init(cfg, 2, 8, bits=True).k[0]
    stored = to_storage(x, bits)
    assert stored.dtype == jnp.uint16
    np.testing.assert_array_equal(
        np.asarray(from_storage(stored, jnp.float32)),
        np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)),
    )
    assert storage_dtype("bfloat16", True) == jnp.uint16
    assert storage_dtype("float32", True) == jnp.float32
    assert storage_dtype("bfloat16", False) == jnp.bfloat16
    f32 = jnp.zeros((1,), jnp.float32)
    assert to_storage(x, f32).dtype == jnp.float32
    assert from_storage(x, "bfloat16").dtype == jnp.bfloat16


def test_a_continued_turn_on_a_bits_cache_equals_the_bf16_cache(tiny_bf16):
    """The next turn of an episode extends its slot's cache (`rollout_engine.jax.extend`)."""
    cfg, graphdef, params = tiny_bf16
    outs = []
    for kv_bits in (True, False):
        bcfg = BatcherConfig(num_slots=2, max_len=64, steps_per_call=8, kv_bits=kv_bits)
        b = ContinuousBatcher(
            cfg, graphdef, params, bcfg, SamplingConfig(temperature=0.0), StopConfig((0,), 1)
        )
        first = (5, 9, 30, 41, 7, 7, 12)
        b.submit([Request("t1", first, 1, 10)])
        (turn1,) = b.run_until_idle()
        history = first + tuple(turn1.tokens.tolist()) + (3, 4, 50)
        b.submit([Request("t2", history, 1, 10, seed=3, continues=True)])
        (turn2,) = b.run_until_idle()
        assert b.continued == 1
        outs.append((turn1, turn2))
    for x, y in zip(outs[0], outs[1], strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)


def test_the_native_attention_kernel_gives_the_xla_paths_tokens(tiny_bf16, monkeypatch):
    """The same 8 samples with the decode step's attention by the native kernel
    (`native_attention=True`, the default: `models.kernels.decode_attention`) and by XLA's
    path over the same bits cache: the kernel is in the compiled loop, greedy tokens are
    equal, and every log-prob within 0.05 nats (bf16 probabilities, summed in another
    order)."""
    from models.kernels import decode_attention as kernel

    calls: list[int] = []
    real = kernel.bits_decode_attention

    def counted(*args, **kwargs):
        calls.append(1)  # counted at trace time: once per compiled loop and layer
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "bits_decode_attention", counted)
    sampling = SamplingConfig(temperature=0.0)
    b_native, native = _run(tiny_bf16, True, sampling, native_attention=True)
    assert calls, "the bits batcher's decode loop must trace the native kernel"
    n_calls = len(calls)
    _, xla = _run(tiny_bf16, True, sampling, native_attention=False)
    assert len(calls) == n_calls  # XLA's path never traces the kernel
    assert len(native) == len(xla) == 8
    assert sum(len(r.tokens) for r in native) > 40
    for x, y in zip(native, xla, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=0.05)
