"""A float32 engine with a bfloat16 KV cache (`BatcherConfig.kv_cache_dtype`): float32
matmuls, every key and value rounded to bfloat16 once when written, the cache held as bits
on CPU and read by the native decode kernel; set from the backend's options."""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest

from gateway import messages as m
from models.checkpoints.tiny import make_tiny_checkpoint
from models.kv_cache import from_storage
from rollout_engine.config import JaxOptions
from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig
from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request


@pytest.fixture(scope="module")
def tiny32(tiny_split):
    """The tiny llama in float32 (compute, params and, by default, the KV cache)."""
    tiny = tiny_split("llama")
    assert tiny[0].dtype == "float32"
    return tiny


def _requests():
    """Four prompts of 6 to 31 random ids, two samples of 20 tokens each."""
    rng = np.random.default_rng(5)
    prompts = [tuple(int(t) for t in rng.integers(1, 64, size=n)) for n in (6, 19, 31, 8)]
    return [Request(i, p, 2, 20) for i, p in enumerate(prompts)]


def _run(tiny, kv_cache_dtype, *, kv_bits=None, native=True, temperature=0.0):
    cfg, graphdef, params = tiny
    bcfg = BatcherConfig(num_slots=4, max_len=64, prefill_batch=2, kv_bits=kv_bits,
                         native_attention=native, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    sampling = SamplingConfig(temperature=temperature)
    b = ContinuousBatcher(cfg, graphdef, params, bcfg, sampling, StopConfig((0,), 1))
    b.submit(_requests())
    res = sorted(b.run_until_idle(), key=lambda r: (r.prompt_id, r.sample_index))
    assert len(res) == 8 and sum(len(r.tokens) for r in res) > 40  # decode ran
    return b, res


def test_bf16_cache_under_a_float32_model_is_bits_and_its_storage_alone_changes_nothing(tiny32):
    """On CPU the bf16 cache is held as bits (uint16); plain bfloat16 storage gives the same
    tokens and log-probs bit for bit (XLA's attention on both), the prefill's cache is in
    the cache dtype (bits too), and layer 0's cached keys of a prompt are the float32
    engine's rounded to bfloat16 exactly (layer 0's keys depend on the embeddings alone)."""
    b_bits, bits = _run(tiny32, "bfloat16", native=False)
    b_plain, plain = _run(tiny32, "bfloat16", kv_bits=False, native=False)
    assert b_bits.state.cache.k[0].dtype == jnp.uint16
    assert b_plain.state.cache.k[0].dtype == jnp.bfloat16
    for x, y in zip(bits, plain, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
    cfg, graphdef, params = tiny32
    prompt = (5, 9, 30, 41, 7, 7, 12, 3, 3, 60)
    for dtype in ("bfloat16", None):
        pre = ContinuousBatcher(
            cfg, graphdef, params, BatcherConfig(num_slots=1, max_len=32, kv_cache_dtype=dtype),
            SamplingConfig(temperature=0.0), StopConfig((0,), 1),
        ).prefiller(params, [prompt])  # fmt: skip
        if dtype == "bfloat16":  # held as bits on CPU, as the slots' cache
            assert pre.cache.k[0].dtype == jnp.uint16
            k16 = np.asarray(from_storage(pre.cache.k[0][0, :, : len(prompt)], jnp.bfloat16))
        else:
            k32 = pre.cache.k[0][0, :, : len(prompt)]
            assert k32.dtype == jnp.float32
    np.testing.assert_array_equal(k16, np.asarray(k32.astype(jnp.bfloat16)))


def test_the_kernel_reads_the_bf16_cache_of_a_float32_model(tiny32, monkeypatch):
    """The decode loop of a float32 model over a bits cache traces the native kernel and
    gives XLA's greedy tokens (log-probs within 0.05 nats); against the float32 cache, every
    first token (sampled from the prefill) keeps its log-prob within 0.02 nats."""
    from models.kernels import decode_attention as kernel

    assert kernel.available(), "the kernel needs g++ (CI and scripts/setup.sh hosts have it)"
    calls: list[int] = []
    real = kernel.bits_decode_attention

    def counted(*args, **kwargs):
        calls.append(1)  # at trace time
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "bits_decode_attention", counted)
    _, native = _run(tiny32, "bfloat16", native=True)
    assert calls, "a float32 model over a bits cache must trace the kernel"
    n = len(calls)
    _, xla = _run(tiny32, "bfloat16", native=False)
    _, full = _run(tiny32, None, native=True)
    assert len(calls) == n  # neither XLA's path nor a float32 cache calls it
    for x, y, z in zip(native, xla, full, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=0.05)
        np.testing.assert_allclose(x.logprobs[0], z.logprobs[0], rtol=0, atol=0.02)


def test_a_continued_turn_on_the_bf16_cache_matches_a_fresh_prefill_of_its_history(tiny32):
    """An episode's next turn continued in its slot (only the new tokens computed over the
    cached bf16 keys) samples what a fresh prefill of the whole history samples: the same
    greedy tokens, log-probs within 0.05 nats (rounding at other points)."""
    cfg, graphdef, params = tiny32
    first = (5, 9, 30, 41, 7, 7, 12)
    outs = []
    for continues in (True, False):
        bcfg = BatcherConfig(num_slots=2, max_len=64, steps_per_call=8,
                             kv_cache_dtype="bfloat16")  # fmt: skip
        b = ContinuousBatcher(
            cfg, graphdef, params, bcfg, SamplingConfig(temperature=0.0), StopConfig((0,), 1)
        )
        b.submit([Request("t1", first, 1, 10)])
        (turn1,) = b.run_until_idle()
        history = first + tuple(turn1.tokens.tolist()) + (3, 4, 50)
        b.submit([Request("t2", history, 1, 10, seed=3, continues=continues)])
        (turn2,) = b.run_until_idle()
        assert b.continued == int(continues)
        outs.append(turn2)
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
    np.testing.assert_allclose(outs[0].logprobs, outs[1].logprobs, rtol=0, atol=0.05)


def test_kv_cache_dtype_refuses_other_dtypes():
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        BatcherConfig(kv_cache_dtype="float16")
    with pytest.raises(pydantic.ValidationError):
        JaxOptions(kv_cache_dtype="int8")  # type: ignore[arg-type]
    assert JaxOptions().kv_cache_dtype == "auto"


def test_the_backend_option_sets_the_replicas_cache(tmp_path):
    """`--jax-kv-cache-dtype bfloat16` on a float32 engine: the replica's cache is bf16 bits
    and a group is served; auto keeps the engine dtype."""
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama", vocab_size=128, with_tokenizer=False)
    greedy = m.SamplingParams(max_new_tokens=6, temperature=0.0)

    async def serve(kv: str):
        backend = JaxBackend(JaxBackendConfig(model=str(path), num_slots=2, max_model_len=32,
                                              dtype="float32", kv_cache_dtype=kv))  # fmt: skip
        await backend.start()
        try:
            (group,) = await asyncio.gather(
                backend.generate(m.Prompt("q", np.asarray([5, 9, 30], np.int32), 2, greedy))
            )
            return backend.engine.replicas[0].state.cache.k[0].dtype, group
        finally:
            await backend.shutdown()

    dtype, group = asyncio.run(serve("bfloat16"))
    assert dtype == jnp.uint16 and jax.devices()[0].platform == "cpu"
    assert len(group) == 2 and all(len(c.token_ids) == 6 for c in group)
    dtype, _ = asyncio.run(serve("auto"))
    assert dtype == jnp.float32
