"""The native embedding lookup (`models.kernels.embed_rows`) against `jnp.take`, and the
engine's compiled decode loop that uses it: no copy of the table per call.

The kernel is built on this host by g++ on first use (`models.kernels.build`); CI machines
have g++, so these tests require it rather than skip without it."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.checkpoints.hf_io import load_hf_checkpoint
from models.kernels.embed_rows import available, embed_rows
from models.kernels.scope import native_scope
from models.kv_cache import KVCache


def test_the_kernel_takes_the_rows_bit_for_bit() -> None:
    """A bf16 [50, 24] table, ids [3, 4] with repeats and both ends of the vocabulary: the
    rows equal `jnp.take`'s bit for bit (bf16 [3, 4, 24]); as `jnp.take`'s, id -1 is the
    last row, ids 50 and -51 (outside the table) give rows of NaN; a float32 table is
    refused."""
    assert available(), "g++ builds the kernel on every machine this project runs on"
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(50, 24)), jnp.bfloat16)
    ids = jnp.asarray([[0, 49, 7, 7], [3, 1, 2, 48], [25, 25, 0, 13]], jnp.int32)
    got = jax.jit(embed_rows)(table, ids)
    assert got.shape == (3, 4, 24) and got.dtype == jnp.bfloat16
    want = jnp.take(table, ids, axis=0)
    bits = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))  # noqa: E731
    np.testing.assert_array_equal(bits(got), bits(want))
    edges = jnp.asarray([50, -51, -1, 4], jnp.int32)
    got = jax.jit(embed_rows)(table, edges)
    assert np.isnan(np.asarray(got[:2], np.float32)).all()
    assert np.isnan(np.asarray(jnp.take(table, edges[:2], axis=0), np.float32)).all()
    np.testing.assert_array_equal(bits(got[2:]), bits(table[jnp.asarray([49, 4])]))
    with pytest.raises(ValueError, match="bfloat16 table"):
        embed_rows(table.astype(jnp.float32), ids)


@pytest.mark.parametrize("family", ["smollm2", "llama"])  # a tied head, an untied one
def test_a_native_cached_forward_copies_no_table_and_no_out_projection(
    tiny_checkpoint, family
) -> None:
    """bf16 model, a cached forward (a decode step's shape) traced inside `native_scope`:
    its compiled program holds no copy of the [V, D] table in any dtype (the bits lookup
    outside the scope copies it through a bitcast) and no copy of any layer's o.kernel
    ([N, H, D], contracted over N·H as stored); its logits equal the same forward's outside
    the scope exactly (the rows are the same bits) and the cache-free forward's within 0.05."""
    cfg, model = load_hf_checkpoint(tiny_checkpoint(family), dtype="bfloat16")
    V, D, N, H = cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.head_dim
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, size=(3, 1)), jnp.int32)
    positions = jnp.zeros((3, 1), jnp.int32)  # a first token: the cache-free forward's own
    cache = KVCache.init(cfg, 3, 8, bits=True)

    def cached(params, tokens, cache):
        return nnx.merge(graphdef, params)(tokens, positions, cache)[0]

    def native(params, tokens, cache):
        with native_scope():
            return cached(params, tokens, cache)

    hlo = jax.jit(native).lower(params, tokens, cache).compile().as_text()
    assert not re.search(rf"\[{V},{D}\]\{{1,0\}} (copy|fusion|bitcast-convert)", hlo), "a copy"
    assert "JaxrlEmbedRows" in hlo
    o_copies = re.findall(rf"= bf16\[{N * H},{D}\]\{{1,0\}} (?:copy|fusion)", hlo)
    assert not o_copies, f"{len(o_copies)} copies of o.kernel"
    outside = jax.jit(cached)(params, tokens, cache)
    plain = jax.jit(cached).lower(params, tokens, cache).compile().as_text()
    assert re.search(rf"u16\[{V},{D}\]", plain), "outside the scope the bits path serves"
    got = jax.jit(native)(params, tokens, cache)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(outside))
    free, _ = model(tokens, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(free), atol=0.05, rtol=0)


def test_a_table_of_the_wrong_rank_is_refused() -> None:
    """A 3-D table (a caller's bug): ValueError naming what the kernel takes, before any call."""
    table = jnp.zeros((2, 50, 24), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"2-D bfloat16 table, got bfloat16\(2, 50, 24\)"):
        embed_rows(table, jnp.zeros((3,), jnp.int32))


def test_without_a_compiler_the_lookup_falls_back_and_gives_the_same_logits(
    tiny_checkpoint, tmp_path
) -> None:
    """A process where the kernel cannot be built (CXX names no program, a fresh kernel
    cache): `available()` is False with a warning, `embed_rows` raises RuntimeError, and a
    cached bf16 forward traced inside `native_scope` takes the bits lookup (no FFI call in
    its program) and gives exactly the logits this process gets with the kernel."""
    import json
    import os
    import subprocess
    import sys

    path = str(tiny_checkpoint("smollm2"))
    code = (
        "import json, jax, jax.numpy as jnp, numpy as np\n"
        "from flax import nnx\n"
        "from models.checkpoints.hf_io import load_hf_checkpoint\n"
        "from models.kernels import embed_rows as k\n"
        "from models.kernels.scope import native_scope\n"
        "from models.kv_cache import KVCache\n"
        f"cfg, m = load_hf_checkpoint({path!r}, dtype='bfloat16')\n"
        "g, p = nnx.split(m)\n"
        "toks = jnp.asarray([[5], [9], [11]], jnp.int32)\n"
        "pos = jnp.zeros((3, 1), jnp.int32)\n"
        "cache = KVCache.init(cfg, 3, 8, bits=True)\n"
        "def f(p, t, c):\n"
        "    with native_scope():\n"
        "        return nnx.merge(g, p)(t, pos, c)[0]\n"
        "hlo = jax.jit(f).lower(p, toks, cache).as_text()\n"
        "try:\n"
        "    k.embed_rows(p['embed']['embedding'][...], toks)\n"
        "    err = ''\n"
        "except RuntimeError as e:\n"
        "    err = str(e)\n"
        "logits = np.asarray(jax.jit(f)(p, toks, cache), np.float32).tolist()\n"
        "print(json.dumps({'available': k.available(), 'ffi': 'JaxrlEmbedRows' in hlo,\n"
        "                  'error': err, 'logits': logits}))\n"
    )

    def run(env_extra: dict) -> tuple[dict, str]:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", **env_extra}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=300, check=True)  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr

    off, stderr = run({"CXX": "no-such-compiler-xyz", "XDG_CACHE_HOME": str(tmp_path)})
    on, _ = run({})
    assert not off["available"] and not off["ffi"], off
    assert off["error"] == "the native embed_rows kernel is not available"
    assert "the native kernel embed_rows is off" in stderr
    assert on["available"] and on["ffi"] and on["error"] == ""
    a, b = np.asarray(off["logits"]), np.asarray(on["logits"])
    assert a.shape == (3, 1, a.shape[-1]) and np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
