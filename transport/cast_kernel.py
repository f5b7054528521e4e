"""Packing's transposed float32 -> bfloat16 cast in one native pass (`transpose_cast.cc`).

The mappings hand a linear layer to the sender as a strided view `[out, in]` of the JAX kernel
`[in, out]`; the bucket wants it contiguous in the wire dtype. torch casts such a view element
by element, or (`transport.base.copy_cast`) in two passes, a contiguous cast and then a
transposed copy of 2-byte elements; both are the slowest part of packing on CPU. The kernel
reads 16 x 16 float32 tiles, transposes them in registers and rounds them to bf16 on the way
out (`benchmarks/transpose_cast.py` measures it against torch's two passes).

Built with the host's g++ on first use (`models.kernels.build.compile_kernel`, cached per
source and CPU) and called through ctypes (the GIL is released during the call). Only where
the tiles are compiled in (a CPU with 512-bit vectors: `jaxrl_transpose_cast_vectorized`);
elsewhere, with no compiler, or with ``JAXRL_CPU_KERNELS=0``, `transpose_cast` returns False
(one warning for a failed build) and the caller keeps torch's copy.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Environment switch shared with the model kernels: "0" turns the native cast off.
ENABLE_ENV = "JAXRL_CPU_KERNELS"
_HERE = Path(__file__).resolve().parent


@functools.cache
def _library() -> Any:
    """The loaded kernel library, or None where it is off or cannot serve (kept per process)."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    from models.kernels.build import KernelBuildError, compile_kernel

    try:
        lib = ctypes.CDLL(str(compile_kernel("transpose_cast", _HERE)))
        fn = lib.jaxrl_transpose_cast_f32_bf16
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_int64]  # fmt: skip
        fn.restype = None
    except (KernelBuildError, OSError, AttributeError, subprocess.TimeoutExpired) as e:
        log.warning("the native transposed cast is off (torch's copy serves): %s", e)
        return None
    return lib if lib.jaxrl_transpose_cast_vectorized() else None


def available() -> bool:
    """True where the kernel is built with its vectorized tiles and loaded (see the module)."""
    return _library() is not None


def transpose_cast(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """`dst.copy_(src)` for a transposed float32 view into bfloat16, natively; or nothing.

    Args:
        dst: `[R, C]` bfloat16, contiguous, on the CPU.
        src: `[R, C]` float32 on the CPU whose rows are contiguous along the other axis:
            strides `(1, ld)` with `ld >= R` (the `.T` of a row-major `[C, ld]` matrix, or a
            slice of rows of one: a TP rank's region).

    Returns:
        True when the kernel wrote `dst` (bit-identical to XLA's cast: round to nearest
        even, as torch's too, and a NaN to the quiet NaN of its sign, where torch's vectorized
        copy writes 0xFFFF); False, with `dst` untouched, for any other dtypes,
        device, layout or shape, or where the kernel is not available.
    """
    import torch

    if (
        src.dtype != torch.float32 or dst.dtype != torch.bfloat16 or src.dim() != 2
        or src.device.type != "cpu" or dst.device.type != "cpu" or not dst.is_contiguous()
        or tuple(dst.shape) != tuple(src.shape)
    ):  # fmt: skip
        return False
    rows, cols = src.shape
    if rows < 16 or cols < 16 or src.stride(0) != 1 or src.stride(1) < rows:
        return False
    lib = _library()
    if lib is None:
        return False
    lib.jaxrl_transpose_cast_f32_bf16(src.data_ptr(), src.stride(1), dst.data_ptr(), rows, cols)
    return True
