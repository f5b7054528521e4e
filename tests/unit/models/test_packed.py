"""Projection weights packed once for the native bf16 kernel (`models.packed`,
`models.kernels.bf16_matmul.pack`): the layout element by element, the packed product equal to
the per-call one bit for bit, which projections get a packed copy, and the model's forward
taking it inside the native scope with the same logits."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import packed as pk
from models.checkpoints.tiny import TINY_CONFIGS
from models.config import ModelConfig
from models.decoder import Decoder
from models.kernels import bf16_matmul
from models.kernels.build import cpu_flags
from models.kernels.scope import native_scope

needs_bf16 = pytest.mark.skipif(
    "avx512_bf16" not in cpu_flags(), reason="no AVX512-BF16 on this CPU (XLA's dot serves)"
)


def _tiny(family: str, params: str = "bfloat16") -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """A tiny random `family` decoder computing in bf16, its params in `params`."""
    cfg = ModelConfig.from_hf(dict(TINY_CONFIGS[family], vocab_size=64, eos_token_id=0))
    cfg = cfg.replace(dtype="bfloat16", param_dtype=params)
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    return cfg, graphdef, params


@pytest.mark.parametrize("k,n", [(6, 130), (5, 64), (1, 1), (128, 192)])
def test_pack_puts_each_k_pair_of_a_64_column_panel_side_by_side(k, n):
    """packed[p, j, c, t] = w[2j + t, 64p + c], zeros past K and N: the layout the kernel's
    own per-call packing writes (checked element by element here, on any CPU)."""
    w = np.arange(1, k * n + 1, dtype=np.float32).reshape(k, n) % 251  # exact in bf16
    got = np.asarray(bf16_matmul.pack(jnp.asarray(w)).astype(jnp.float32))
    assert got.shape == bf16_matmul.packed_shape(k, n) == (-(-n // 64), -(-k // 2), 64, 2)
    want = np.zeros(got.shape, np.float32)
    for p, j, c, t in np.ndindex(*got.shape):
        if 2 * j + t < k and 64 * p + c < n:
            want[p, j, c, t] = w[2 * j + t, 64 * p + c]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"\[K, N\]"):
        bf16_matmul.pack(jnp.zeros((2, 3, 4)))


@needs_bf16
@pytest.mark.parametrize(
    "m,k,n", [(64, 576, 1536), (64, 1536, 576), (1, 576, 192), (13, 33, 70), (8, 2, 5), (3, 1, 1)]
)
def test_the_packed_product_is_the_per_call_product_bit_for_bit(m, k, n):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    got = jax.jit(lambda a, p: bf16_matmul.bf16_matmul_packed(a, p, n))(x, bf16_matmul.pack(w))
    per_call = jax.jit(bf16_matmul.bf16_matmul)(x, w)
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(per_call))
    want = jnp.dot(x, w, preferred_element_type=jnp.float32)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * scale)


@needs_bf16
def test_a_packed_operand_of_another_shape_or_dtype_is_refused():
    x = jnp.zeros((4, 10), jnp.bfloat16)
    packed = bf16_matmul.pack(jnp.zeros((10, 70)))
    with pytest.raises(ValueError, match="packed"):
        bf16_matmul.bf16_matmul_packed(x, packed, 130)  # N of another panel count
    with pytest.raises(ValueError, match="packed"):
        bf16_matmul.bf16_matmul_packed(jnp.zeros((4, 12), jnp.bfloat16), packed, 70)  # K
    with pytest.raises(ValueError, match="packed"):
        bf16_matmul.bf16_matmul_packed(x, packed.astype(jnp.float32), 70)
    with pytest.raises(ValueError, match="bfloat16"):
        bf16_matmul.bf16_matmul_packed(x.astype(jnp.float32), packed, 70)


@pytest.mark.parametrize("family,per_layer", [("llama", 7), ("qwen3_moe", 4)])
def test_every_dense_projection_gets_a_packed_copy_and_nothing_else_changes(family, per_layer):
    """q, k, v, o and a dense MLP's gate, up, down; not a mixture of experts' router and
    experts. Every other leaf is the same array, not a copy."""
    cfg, graphdef, params = _tiny(family)
    new_graphdef, new_params = pk.with_packed(graphdef, params)
    packed = jax.tree.leaves(nnx.filter_state(new_params, pk.PackedKernel))
    assert len(packed) == per_layer * cfg.num_layers + 1  # and the LM head
    assert all(p.dtype == jnp.bfloat16 for p in packed)
    assert pk.packed_bytes(new_params) == sum(2 * math.prod(p.shape) for p in packed)
    rest = nnx.filter_state(new_params, nnx.Not(pk.PackedKernel))
    for a, b in zip(jax.tree.leaves(rest), jax.tree.leaves(params), strict=True):
        assert a is b
    model = nnx.merge(new_graphdef, new_params)
    q = model.layers[0].attn.q
    d, heads, hd = q.kernel.shape
    np.testing.assert_array_equal(
        np.asarray(q.packed[...]),
        np.asarray(bf16_matmul.pack(q.kernel[...].reshape(d, heads * hd))),
    )
    o = model.layers[0].attn.o  # [N, H, D]: two input dims
    assert o.packed.shape == bf16_matmul.packed_shape(heads * hd, d)
    assert model.lm_head_packed.shape == bf16_matmul.packed_shape(d, cfg.vocab_size)
    # packing again from a packed state packs afresh from the kernels
    again = pk.with_packed(new_graphdef, new_params)[1]
    assert len(jax.tree.leaves(nnx.filter_state(again, pk.PackedKernel))) == len(packed)
    # float32 params: the head runs in float32 (`Decoder.logits`), so it is not packed
    _, graphdef32, params32 = _tiny(family, params="float32")
    model32 = nnx.merge(*pk.with_packed(graphdef32, params32))
    assert not hasattr(model32, "lm_head_packed")
    assert model32.layers[0].attn.q.packed.dtype == jnp.bfloat16


@needs_bf16
@pytest.mark.parametrize("family", ["llama", "smollm2", "qwen3_moe"])  # untied, tied head, MoE
def test_the_forward_takes_the_packed_copies_in_scope_with_the_same_logits(family):
    """The projections' products are the per-call kernel's bit for bit; the LM head's, XLA's
    dot's up to summation order."""
    cfg, graphdef, params = _tiny(family)
    packed_graphdef, packed_params = pk.with_packed(graphdef, params)
    tokens = jnp.asarray([[3, 9, 17], [5, 1, 2]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))

    def forward(gd):
        return jax.jit(lambda p, t, s: nnx.merge(gd, p)(t, s)[0])

    with native_scope(True):
        text = forward(packed_graphdef).lower(packed_params, tokens, positions).as_text()
        got = forward(packed_graphdef)(packed_params, tokens, positions)
        want = forward(graphdef)(params, tokens, positions)  # packed per call
    calls = len(pk.projections(nnx.merge(graphdef, params))) + 1  # and the head's
    assert text.count(f"@{bf16_matmul.PACKED_TARGET}") == calls
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * scale)
    with native_scope(False):  # outside the scope the packed copies are not read
        text = forward(packed_graphdef).lower(packed_params, tokens, positions).as_text()
    assert bf16_matmul.PACKED_TARGET not in text
