"""The native bf16 projection kernel (`models.kernels.bf16_matmul`): XLA's float32-accumulated
dot of the same operands on whole and ragged shapes, the engine's projections take it only
inside the native scope and only up to `NATIVE_MATMUL_MAX_ROWS` rows, and bad operands are
refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers
from models.kernels import bf16_matmul
from models.kernels.build import cpu_flags
from models.kernels.scope import native_scope

# by the CPU's flags, not by `available()`: a failed build on a CPU that has them fails here
pytestmark = pytest.mark.skipif(
    "avx512_bf16" not in cpu_flags(), reason="no AVX512-BF16 on this CPU (XLA's dot serves)"
)


def _operands(m: int, k: int, n: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    return x, w


@pytest.mark.parametrize(
    "m,k,n",
    [(64, 576, 1536), (64, 1536, 576), (1, 576, 192), (13, 33, 70), (8, 2, 5), (100, 17, 64)],
)
def test_products_equal_xlas_float32_accumulated_dot(m, k, n):
    """Whole 8-row blocks and 64-column panels, ragged rows, columns and an odd K."""
    x, w = _operands(m, k, n)
    got = jax.jit(bf16_matmul.bf16_matmul)(x, w)
    want = jnp.dot(x, w, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    # bf16 products are exact in float32; only the summation order differs
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * scale)


def test_the_engine_projection_takes_it_in_scope_up_to_the_row_bound():
    rng = np.random.default_rng(1)
    kernel = jnp.asarray(rng.standard_normal((64, 4, 16)), jnp.bfloat16)  # [D, N, H]

    def q_proj(x):
        return layers.project("btd,dnh->btnh", x, kernel, "bfloat16")

    def lowered(x, on):  # a fresh function each time: jit's trace cache ignores the scope
        with native_scope(on):
            return jax.jit(lambda v: q_proj(v)).lower(x).as_text()

    small = jnp.asarray(rng.standard_normal((8, 1, 64)), jnp.float32)  # 8 rows
    large = jnp.zeros((8, 16, 64), jnp.float32)  # 128 rows: XLA's dot
    assert bf16_matmul.TARGET in lowered(small, True)
    assert bf16_matmul.TARGET not in lowered(small, False)
    assert bf16_matmul.TARGET not in lowered(large, True)
    with native_scope(True):
        got = jax.jit(lambda v: q_proj(v))(small)
    want = q_proj(small)  # outside the scope: XLA's einsum
    assert got.shape == (8, 1, 4, 16) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-4)
    # a contraction over another dim than the kernel's first never takes it
    with native_scope(True):
        assert not layers.native_rows("btd,nhd->btnh", small)


def test_bad_operands_are_refused():
    x, w = _operands(4, 8, 16)
    with pytest.raises(ValueError, match="bfloat16 operands"):
        bf16_matmul.bf16_matmul(x.astype(jnp.float32), w)
    with pytest.raises(ValueError, match=r"\[M, K\] x \[K, N\]"):
        bf16_matmul.bf16_matmul(x, w[:7])
    with pytest.raises(ValueError, match=r"\[M, K\] x \[K, N\]"):
        bf16_matmul.bf16_matmul(x[None], w)
