"""The native decode attention kernel (`models.kernels.decode_attention`) against the XLA path
(`models.layers.decode_attention` on the same bf16 cache), its build and its off switches.

The kernel is built on this host by g++ on first use (`models.kernels.build`); CI machines
have g++, so these tests require it rather than skip without it."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.checkpoints.hf_io import load_hf_checkpoint
from models.kernels import build
from models.kernels.decode_attention import available, bits_decode_attention
from models.kv_cache import to_storage
from models.layers import decode_attention
from models.scores import attention_mask

B, S = 6, 37


@pytest.mark.parametrize(
    ("softcap", "window", "heads"),
    [(None, None, None), (30.0, 6, None), (None, None, (3, 3, 64)), (30.0, 6, (2, 4, 128)),
     (None, None, (1, 8, 64)), (None, 20, (2, 2, 128))],
)  # fmt: skip
def test_the_kernel_equals_the_xla_path_on_the_bits_cache(tiny_checkpoint, softcap, window, heads):
    """6 rows at positions 0, 3, 11, 17, 36 and one past the cache (S = 37; slots past a row's
    position hold values that must stay unseen), the tiny model's 2 KV heads of 2 query heads
    each and (K, G, H) shapes of real models (SmolLM2's 3, 3, 64; with AVX512_BF16 these take
    the kernel's VDPBF16PS path, 16 slots of scores at a time: 1, 4, 12, 18 and 37 visible
    slots cover whole, partial and odd blocks), with and without Gemma 2's soft cap and a
    sliding window: within 2**-7 of the largest output of the XLA path over the same bf16
    values (both round the query and probabilities to bf16; they differ in summation order
    and the output's rounding point), bf16 out; the row past the cache gets zeros; row 0
    (one visible slot) gets that slot's values exactly."""
    assert available(), "g++ builds the kernel on every machine this project runs on"
    cfg, _ = load_hf_checkpoint(tiny_checkpoint("llama"), dtype="bfloat16")
    cfg = dataclasses.replace(cfg, attn_logit_softcap=softcap)
    if heads is not None:
        k, g, h = heads
        cfg = dataclasses.replace(cfg, num_kv_heads=k, num_heads=k * g, head_dim=h,
                                  query_scale=h**-0.5)  # fmt: skip
    K, G, H = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    assert heads is not None or (K >= 2 and G >= 2)
    rng = np.random.default_rng(1)
    bf = jnp.bfloat16
    q = jnp.asarray(rng.normal(size=(B, 1, K, G, H)), bf)
    keys = jnp.asarray(rng.normal(size=(B, K, S, H)), bf)
    values = jnp.asarray(rng.normal(size=(B, K, S, H)), bf)
    bits = jnp.zeros((B, K, S, H), jnp.uint16)
    k_bits, v_bits = to_storage(keys, bits), to_storage(values, bits)
    positions = jnp.asarray([0, 3, 11, 17, 36, S], jnp.int32)

    got = jax.jit(lambda *a: bits_decode_attention(*a, cfg, window))(q, k_bits, v_bits, positions)
    slots = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    mask = attention_mask(positions[:, None], slots, window)[:, 0]  # [B, S]
    want = decode_attention(q, keys, values, mask, cfg)
    assert got.shape == (B, 1, K, G, H) and got.dtype == bf
    g32, w32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
    live = slice(0, B - 1)
    assert np.abs(g32[live] - w32[live]).max() <= 2**-7 * max(1.0, np.abs(w32[live]).max())
    np.testing.assert_array_equal(g32[B - 1], 0.0)
    first = jnp.broadcast_to(values[0, :, 0][:, None, :], (K, G, H))
    np.testing.assert_array_equal(g32[0, 0], np.asarray(first, np.float32))


def test_a_layer_uses_the_kernel_on_a_bits_cache_and_matches_the_xla_path(tiny_checkpoint):
    """A decode step of the tiny llama in bf16 over a bits cache traced inside `native_scope`:
    the logits with the kernel and with JAXRL_CPU_KERNELS=0 (the XLA path; a fresh process,
    since the switch is read once) agree within 2**-5 of the largest logit, and only the
    first compiles an FFI call; outside the scope no FFI call either way."""
    code = (
        "import sys, json, jax, jax.numpy as jnp, numpy as np\n"
        "from models.checkpoints.hf_io import load_hf_checkpoint\n"
        "from models.kv_cache import KVCache\n"
        f"cfg, m = load_hf_checkpoint({str(tiny_checkpoint('llama'))!r}, dtype='bfloat16')\n"
        "cache = KVCache.init(cfg, 3, 16, bits=True)\n"
        "toks = jnp.asarray([[5, 9, 11, 3]] * 3, jnp.int32)\n"
        "pos = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (3, 4))\n"
        "_, cache = m(toks, pos, cache)\n"
        "from models.kernels.scope import native_scope\n"
        "def step(t, p, c):\n"
        "    with native_scope():\n"
        "        return m(t, p, c)[0]\n"
        "f = jax.jit(step)\n"
        "t1, p1 = jnp.asarray([[7], [8], [2]], jnp.int32), jnp.full((3, 1), 4, jnp.int32)\n"
        "hlo = f.lower(t1, p1, cache).as_text()\n"
        "plain = jax.jit(lambda t, p, c: m(t, p, c)[0]).lower(t1, p1, cache).as_text()\n"
        "print(json.dumps({'ffi': 'JaxrlDecodeAttention' in hlo,\n"
        "                  'plain_ffi': 'JaxrlDecodeAttention' in plain,\n"
        "                  'logits': np.asarray(f(t1, p1, cache), np.float32).tolist()}))\n"
    )
    import json

    def run(switch: str) -> dict:
        env = {**os.environ, build.ENABLE_ENV: switch, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=300, check=True)  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    on, off = run("1"), run("0")
    assert on["ffi"] and not off["ffi"] and not on["plain_ffi"] and not off["plain_ffi"]
    a, b = np.asarray(on["logits"]), np.asarray(off["logits"])
    assert a.shape == b.shape == (3, 1, a.shape[-1])
    assert np.abs(a - b).max() <= 2**-5 * max(1.0, np.abs(b).max())


def test_a_missing_compiler_is_a_clear_build_error_and_the_kernel_stays_off(tmp_path):
    """CXX naming no program: `compile_kernel` raises KernelBuildError naming the compiler;
    `available()` in such a process (fresh cache) is False with a warning, not an error."""
    env = {**os.environ, "CXX": "no-such-compiler-xyz", "XDG_CACHE_HOME": str(tmp_path),
           "JAX_PLATFORMS": "cpu"}  # fmt: skip
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from models.kernels import build\n"
        "from models.kernels.decode_attention import available\n"
        "try:\n"
        "    build.compile_kernel('decode_attention')\n"
        "except build.KernelBuildError as e:\n"
        "    print('error:', e)\n"
        "print('available:', available())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert "error: no C++ compiler (g++ or $CXX) on PATH" in out.stdout
    assert "available: False" in out.stdout
    assert "the native kernel decode_attention is off" in out.stderr
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left in the cache


def test_a_failing_compile_leaves_no_file_and_names_the_error(tmp_path, monkeypatch):
    """A compiler that fails (here `false`): KernelBuildError with the command, and no
    temporary or partial library left in the cache folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(build.KernelBuildError, match="failed"):
        build.compile_kernel("decode_attention")
    assert not list(tmp_path.rglob("*.so"))


def test_mismatched_shapes_are_refused_with_a_clear_error(tiny_checkpoint):
    """Positions for fewer rows than the cache holds (a caller's bug): the call fails naming
    the mismatch instead of reading past a buffer."""
    assert available()
    cfg, _ = load_hf_checkpoint(tiny_checkpoint("llama"), dtype="bfloat16")
    K, G, H = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    q = jnp.zeros((3, 1, K, G, H), jnp.bfloat16)
    cache = jnp.zeros((3, K, 8, H), jnp.uint16)
    with pytest.raises(Exception, match="mismatched shapes"):
        jax.block_until_ready(
            bits_decode_attention(q, cache, cache, jnp.zeros(2, jnp.int32), cfg, None)
        )


def test_a_call_over_the_first_rows_of_a_larger_cache_reads_them_in_place(tiny_checkpoint):
    """3 queries over a 7-row cache (the decode loop's row bound: the layers read the first
    rows of the whole cache, no copy) give exactly the outputs of the same queries over the
    cache's first 3 rows; a cache with fewer rows than the queries is refused."""
    assert available()
    cfg, _ = load_hf_checkpoint(tiny_checkpoint("llama"), dtype="bfloat16")
    K, G, H = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(3, 1, K, G, H)), jnp.bfloat16)
    like = jnp.zeros((), jnp.uint16)
    keys = to_storage(jnp.asarray(rng.normal(size=(7, K, 12, H)), jnp.bfloat16), like)
    values = to_storage(jnp.asarray(rng.normal(size=(7, K, 12, H)), jnp.bfloat16), like)
    positions = jnp.asarray([2, 11, 5], jnp.int32)
    call = jax.jit(lambda q, k, v, p: bits_decode_attention(q, k, v, p, cfg, None))
    whole = np.asarray(call(q, keys, values, positions), np.float32)
    first = np.asarray(call(q, keys[:3], values[:3], positions), np.float32)
    np.testing.assert_array_equal(whole, first)
    assert np.abs(whole).max() > 0.1  # real outputs, not zeros
    with pytest.raises(Exception, match="mismatched shapes"):
        jax.block_until_ready(call(q, keys[:2], values[:2], positions))
