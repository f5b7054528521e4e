"""The engine's bfloat16 projections as a native CPU kernel (``bf16_matmul.cc``):
`models.layers.project` multiplies x [M, K] by a kernel [K, N] through it inside
`models.kernels.scope.native_scope` where `available()`.

XLA:CPU's bf16 dot with float32 accumulation runs the decode step's shapes (64 rows by SmolLM2's
576 x 1536 and 1536 x 576) at about 0.6 of what the two cores' VDPBF16PS instructions allow;
the kernel packs each 64-column panel of the weight once per call into that instruction's
operand layout and multiplies every 8-row block by it (`benchmarks/bf16_matmul.py` measures
both on the same shapes). Only on CPUs with AVX512-BF16 (the compiler's ``-march=native``
defines ``__AVX512BF16__``): elsewhere `available()` is False and XLA's dot serves.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.kernels.build import compile_kernel, load
from models.kernels.decode_attention import threads
from models.kernels.scope import in_native_scope

#: The FFI target (the handler symbol of ``bf16_matmul.cc``).
TARGET = "JaxrlBf16Matmul"


@functools.cache
def available() -> bool:
    """True where the kernel is compiled with VDPBF16PS, loaded and registered."""
    if not load("bf16_matmul", (TARGET,)):
        return False
    lib = ctypes.CDLL(str(compile_kernel("bf16_matmul")))
    return bool(lib.jaxrl_bf16_matmul_supported())


def active() -> bool:
    """True inside `models.kernels.scope.native_scope()` where the kernel is `available()`."""
    return in_native_scope() and available()


def bf16_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.dot(x, w, preferred_element_type=float32)`` of bfloat16 operands by the kernel:
    the same products, accumulated in float32 in another order (VDPBF16PS rounds after
    each pair of products and treats denormal inputs as zero), so results may differ from
    XLA's in the last float32 bits.

    Args:
        x: bfloat16 [M, K]. w: bfloat16 [K, N] (row-major, as the params hold it).

    Returns:
        float32 [M, N].

    Raises:
        RuntimeError: `available()` is False (take XLA's dot instead).
        ValueError: operands that are not 2-D bfloat16 with matching K.
    """
    if not available():
        raise RuntimeError("the native bf16_matmul kernel is not available")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"bf16_matmul takes [M, K] x [K, N], got {x.shape} x {w.shape}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"bf16_matmul takes bfloat16 operands, got {x.dtype} and {w.dtype}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32))
    return call(x, w, threads=np.int64(threads()))
