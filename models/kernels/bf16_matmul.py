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

#: The FFI targets (the handler symbols of ``bf16_matmul.cc``): the weight packed per call,
#: and given packed (`pack`).
TARGET = "JaxrlBf16Matmul"
PACKED_TARGET = "JaxrlBf16MatmulPacked"

#: Columns per packed panel (the kernel's 4 vectors of 16 float32 accumulators).
PANEL = 64


@functools.cache
def available() -> bool:
    """True where the kernel is compiled with VDPBF16PS, loaded and registered."""
    if not load("bf16_matmul", (TARGET, PACKED_TARGET)):
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


def packed_shape(k: int, n: int) -> tuple[int, int, int, int]:
    """The shape `pack` gives a [K, N] weight: [ceil(N / 64), ceil(K / 2), 64, 2]."""
    return (-(-n // PANEL), -(-k // 2), PANEL, 2)


def pack(w: jax.Array) -> jax.Array:
    """A weight in the kernel's operand layout, once per weight version rather than per call:
    packed[p, j, c, t] = w[2j + t, 64p + c] (zeros past K and N): each 64-column panel's
    k-pairs side by side, as VDPBF16PS multiplies them. Plain XLA (a pad, a reshape and a
    transpose), so it runs anywhere; only `bf16_matmul_packed` needs the kernel.

    Args:
        w: [K, N], any float dtype (cast to bfloat16).

    Returns:
        bfloat16 `packed_shape(K, N)`.

    Raises:
        ValueError: w is not 2-D.
    """
    if w.ndim != 2:
        raise ValueError(f"pack takes a [K, N] weight, got shape {w.shape}")
    k, n = w.shape
    p, j, _, _ = packed_shape(k, n)
    w = jnp.pad(w.astype(jnp.bfloat16), ((0, 2 * j - k), (0, PANEL * p - n)))
    return w.reshape(j, 2, p, PANEL).transpose(2, 0, 3, 1)


def bf16_matmul_packed(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    """`bf16_matmul` of x and the weight `pack` gave `packed`: the same products, without the
    per-call packing (about a quarter of `bf16_matmul`'s time at 64 rows;
    `benchmarks/bf16_matmul.py`).

    Args:
        x: bfloat16 [M, K]. packed: bfloat16 `packed_shape(K, n)`. n: the weight's N.

    Returns:
        float32 [M, n].

    Raises:
        RuntimeError: `available()` is False.
        ValueError: x not 2-D bfloat16, or `packed` not of `packed_shape(K, n)` in bfloat16.
    """
    if not available():
        raise RuntimeError("the native bf16_matmul kernel is not available")
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"bf16_matmul_packed takes x bfloat16 [M, K], got {x.dtype} {x.shape}")
    want = packed_shape(x.shape[1], n)
    if packed.shape != want or packed.dtype != jnp.bfloat16:
        raise ValueError(
            f"bf16_matmul_packed: packed {packed.dtype} {packed.shape} is not bfloat16 {want} "
            f"(x {x.shape}, n {n})"
        )
    call = jax.ffi.ffi_call(PACKED_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, packed, threads=np.int64(threads()))
