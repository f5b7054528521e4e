"""The rope inside the native scope (cos / sin materialised through an identity product,
`models.layers._materialized`) rotates to the same bits as outside it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import RopeConfig
from models.kernels.scope import native_scope
from models.layers import apply_rope, rope_inv_freq


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rope", [RopeConfig(theta=100000.0), RopeConfig(
    rope_type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=8192)])  # fmt: skip
def test_the_native_scope_rotates_to_the_same_bits(dtype, rope) -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 37, 9, 64)), dtype)
    positions = jnp.asarray(rng.integers(0, 100_000, (4, 37)), jnp.int32)
    inv_freq = rope_inv_freq(rope, 64)

    def native(x, positions, inv_freq):
        with native_scope():
            return apply_rope(x, positions, inv_freq)

    plain = jax.jit(apply_rope)(x, positions, inv_freq)
    got = jax.jit(native)(x, positions, inv_freq)
    bits = jnp.uint16 if dtype == "bfloat16" else jnp.uint32
    np.testing.assert_array_equal(np.asarray(got.view(bits)), np.asarray(plain.view(bits)))
    assert float(jnp.max(jnp.abs(plain.astype(jnp.float32) - x.astype(jnp.float32)))) > 0.1
