"""The native transposed float32 -> bf16 cast of packing (`transport.cast_kernel`): the bits of
XLA's cast for every value kind, tiles and edges, row slices; refused layouts leave the
destination alone; a failed build or the switch off leaves torch's copy."""

import ctypes
import logging

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models.kernels.build import compile_kernel, cpu_flags
from transport import cast_kernel
from transport.base import copy_cast

SPECIAL = np.array(
    [0x7FC00001, 0xFFC00000, 0x7F800001, 0xFFFFFFFF,  # NaNs: quiet, of their sign
     0x7F800000, 0xFF800000, 0x00000001, 0x80000001,  # infinities, denormals
     0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00000000],  # ties to even, the largest finite
    np.uint32,
)  # fmt: skip


def _matrix(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A float32 [rows, cols] with ties and every special value of SPECIAL in it."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((rows, cols)).astype(np.float32)
    bits = base.view(np.uint32)
    bits[::3] = (bits[::3] & 0xFFFF0000) | 0x8000  # exact ties
    flat = bits.reshape(-1)
    flat[7 : 7 + len(SPECIAL)] = SPECIAL
    flat[-len(SPECIAL) :] = SPECIAL
    return base


def _xla_bits(x: np.ndarray) -> np.ndarray:
    """XLA's cast of `x` to bf16, as uint16 bits."""
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def test_the_library_writes_xlas_bits_on_tiles_and_edges():
    """The compiled function itself (vectorized tiles where the host has AVX-512F, else the
    scalar loop), called on shapes with and without whole 16 x 16 tiles."""
    lib = ctypes.CDLL(str(compile_kernel("transpose_cast", cast_kernel._HERE)))
    fn = lib.jaxrl_transpose_cast_f32_bf16
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64]  # fmt: skip
    for cols_in, rows_in in ((64, 48), (37, 53), (16, 16), (100, 17), (5, 7), (96, 40)):
        src = _matrix(cols_in, rows_in)  # JAX [in, out] = [C, R]; the cast writes [R, C]
        dst = np.zeros((rows_in, cols_in), np.uint16)
        fn(src.ctypes.data, rows_in, dst.ctypes.data, rows_in, cols_in)
        np.testing.assert_array_equal(dst, _xla_bits(src.T))


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="no AVX-512F tiles on this CPU")
def test_a_transposed_view_and_a_row_slice_cast_to_xlas_bits():
    src = _matrix(576, 192, seed=1)  # a k_proj: JAX [D, K*H]
    view = torch.from_numpy(src).T  # [192, 576], strides (1, 192)
    dst = torch.zeros(192, 576, dtype=torch.bfloat16)
    assert cast_kernel.transpose_cast(dst, view)
    np.testing.assert_array_equal(_bits(dst), _xla_bits(src.T))
    rows = torch.zeros(48, 576, dtype=torch.bfloat16)  # a TP rank's rows 64..112
    assert cast_kernel.transpose_cast(rows, view[64:112])
    np.testing.assert_array_equal(_bits(rows), _xla_bits(src.T[64:112]))
    # finite values are torch's bits too (torch differs on NaN only: 0xFFFF)
    finite = torch.from_numpy(np.random.default_rng(2).standard_normal((80, 32), np.float32))
    out = torch.empty(32, 80, dtype=torch.bfloat16)
    assert cast_kernel.transpose_cast(out, finite.T)
    assert torch.equal(out, finite.T.to(torch.bfloat16))


def test_layouts_it_does_not_serve_are_refused_untouched():
    src = torch.from_numpy(_matrix(64, 32)).T  # [32, 64], strides (1, 32)
    cases = [
        (torch.zeros(32, 64, dtype=torch.float16), src),  # another wire dtype
        (torch.zeros(32, 64, dtype=torch.bfloat16), src.contiguous()),  # not transposed
        (torch.zeros(32, 64, dtype=torch.bfloat16), src.double()),  # float64 source
        (torch.zeros(8, 64, dtype=torch.bfloat16), src[:8]),  # fewer than 16 rows
        (torch.zeros(64, 32, dtype=torch.bfloat16).T, src),  # a strided destination
        (torch.zeros(31, 64, dtype=torch.bfloat16), src),  # shapes that differ
    ]
    for dst, s in cases:
        before = dst.clone()
        assert not cast_kernel.transpose_cast(dst, s)
        assert torch.equal(dst, before)


def test_the_switch_off_and_a_failed_build_leave_torchs_copy(monkeypatch, tmp_path, caplog):
    plain = np.random.default_rng(4).standard_normal((64, 48)).astype(np.float32)
    src = torch.from_numpy(plain).T  # finite values: torch's bits are XLA's
    want_bits = _xla_bits(plain.T)
    try:
        monkeypatch.setenv(cast_kernel.ENABLE_ENV, "0")
        cast_kernel._library.cache_clear()
        dst = torch.zeros(48, 64, dtype=torch.bfloat16)
        assert not cast_kernel.transpose_cast(dst, src)
        copy_cast(dst, src)
        np.testing.assert_array_equal(_bits(dst), want_bits)

        monkeypatch.delenv(cast_kernel.ENABLE_ENV)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached: it must build
        monkeypatch.setenv("CXX", "false")  # a compiler that fails
        cast_kernel._library.cache_clear()
        with caplog.at_level(logging.WARNING, logger="transport.cast_kernel"):
            assert not cast_kernel.available()
        assert "the native transposed cast is off" in caplog.text
        assert not list(tmp_path.rglob("*.so"))  # no half-written library left
        dst = torch.zeros(48, 64, dtype=torch.bfloat16)
        copy_cast(dst, src)
        np.testing.assert_array_equal(_bits(dst), want_bits)
    finally:
        monkeypatch.undo()
        cast_kernel._library.cache_clear()
