"""The decode step's attention over a bits KV cache as a native CPU kernel
(``decode_attention.cc``): `models.layers` calls it for one query position per row over a
uint16 (bfloat16 bit patterns) head-major cache, where `available()`.

XLA's CPU path (`models.layers.decode_attention`) first copies every layer's cache out of its
uint16 bits into bfloat16 (XLA emits the bitcast as a copy), then runs B·K small products
([G, H] x [H, S]) per layer; the kernel reads each row's visible slots once, straight from
the bits, and skips the slots past the row's position (a bucket of `kv_len` slots costs what
the rows hold, not the bucket). Measured on a 2-core Intel Xeon with AMX (avx512_bf16),
SmolLM2's shapes (K = 3, G = 3, H = 64), 30 layers in a chain, 128 rows at position 200 of
288 slots: XLA 362 ms, the kernel 86 ms (`benchmarks/decode_attention_kernel.py`); the whole
decode step 295 -> 197 ms (docs/benchmarks.md).

Where the compiler targets AVX512_BF16 (``-march=native`` on such a CPU) and H is 64 or 128,
both products run as VDPBF16PS on the bits as stored (`decode_attention.cc`): on a 2-core
AMD EPYC with avx512_bf16, the same 30 layers 74.0 -> 61.4 ms in one run; per pair and
visible slot 14.6 -> 9.5 ns of compute with the cache in L2, one thread, while from memory
both paths take about 24 ns, so a call over a cache bigger than the caches reads it at
about half the machine's read bandwidth either way.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.kernels.build import load
from models.kernels.scope import in_native_scope

#: The FFI target (the handler symbol of ``decode_attention.cc``).
TARGET = "JaxrlDecodeAttention"


def active() -> bool:
    """True inside `models.kernels.scope.native_scope()` where the kernel is `available()`."""
    return in_native_scope() and available()


def available() -> bool:
    """True where the kernel is compiled, loaded and registered (`models.kernels.build`)."""
    return load("decode_attention", (TARGET,))


def threads() -> int:
    """Threads per call: the CPUs this process may run on, at most 16."""
    return max(1, min(16, len(os.sched_getaffinity(0))))


def bits_decode_attention(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    positions: jax.Array,
    cfg: ModelConfig,
    window: int | None,
) -> jax.Array:
    """Attention of one query per row over the uint16 bits of a bfloat16 head-major cache.

    Row b attends to slots [lo_b, positions[b]] (lo_b = positions[b] - window + 1 on a
    sliding layer, else 0), which must already hold the row's keys and values (slot =
    position); scores scaled by `cfg.query_scale`, soft-capped by `cfg.attn_logit_softcap`,
    softmax in float32, probabilities rounded to bfloat16 and the output accumulated in
    float32 (as `models.layers.decode_attention` on the bfloat16 cache, up to summation
    order). A row whose position is outside [0, S) gets zeros.

    Args:
        q: [B, 1, K, G, H], any float dtype (taken as float32).
        keys / values: uint16 [Bc, K, S, H], Bc >= B, the cache as stored
            (`models.kv_cache`); rows b < B are read (in place: a call over the first B
            rows of a larger cache copies nothing).
        positions: int32 [B], each row's query position.
        window: the sliding window in tokens, or None.

    Returns:
        [B, 1, K, G, H] bfloat16.

    Raises:
        RuntimeError: `available()` is False (call the XLA path instead).
    """
    if not available():
        raise RuntimeError("the native decode attention kernel is not available")
    q4 = q[:, 0].astype(jnp.float32)  # [B, K, G, H]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q4.shape, jnp.float32))
    out = call(
        q4, keys, values, positions.astype(jnp.int32),
        scale=np.float32(cfg.query_scale), softcap=np.float32(cfg.attn_logit_softcap or 0.0),
        window=np.int64(window or 0), threads=np.int64(threads()),
    )  # fmt: skip
    return out.astype(jnp.bfloat16)[:, None]
