"""Projection weights held a second time in the native bf16 kernel's operand layout, packed once
per weight version instead of in every call (`models.kernels.bf16_matmul.pack`).

The JAX engine's one-device replica attaches them (`with_packed`) when it gets weights; inside
`models.kernels.scope.native_scope` a projection of at most `models.layers.PACKED_MATMUL_MAX_ROWS`
rows then multiplies by its packed copy (`models.layers.project`), while prefill's thousands of
rows keep XLA's dot on the kernel as stored. Packing per call cost about a quarter of the
kernel's time at the decode step's 64 rows (`benchmarks/bf16_matmul.py`: `packed_over_xla`
against `native_over_xla`). The LM head is packed too (`models.decoder.Decoder.logits`). The
price is a second copy of those weights in bf16 (`packed_bytes`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.kernels import bf16_matmul
from models.layers import Projection
from models.lora import input_dims


class PackedKernel(nnx.Variable):
    """A projection's kernel [inputs..., outputs...] flattened to [K, N] and packed:
    bfloat16 `bf16_matmul.packed_shape(K, N)`. Never trained (not an `nnx.Param`)."""


def projections(model: nnx.Module) -> list[Projection]:
    """The projections of `model` whose every call is a plain x [..., K] @ kernel [K, ...]
    product: attention's q, k, v, o and the dense MLP's gate, up, down (not a mixture of
    experts' routers and experts, whose kernels carry the `experts` axis)."""
    return [
        node
        for _, node in nnx.iter_graph(model)
        if isinstance(node, Projection) and "experts" not in _axes(node)
    ]


def _axes(proj: Projection) -> tuple[str, ...]:
    return tuple(proj.kernel.get_metadata()["out_sharding"])


def _flat(proj: Projection) -> jax.Array:
    """The kernel as [K, N]: its input dims (`models.lora.input_dims`) times its output dims."""
    w = proj.kernel[...]
    n_in = input_dims(_axes(proj))
    return w.reshape(math.prod(w.shape[:n_in]), -1)


@jax.jit
def _pack_all(kernels: list[jax.Array]) -> list[jax.Array]:
    return [bf16_matmul.pack(w) for w in kernels]


def with_packed(graphdef: nnx.GraphDef, params: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
    """The model ``nnx.merge(graphdef, params)`` with a `PackedKernel` ``packed`` beside the
    kernel of each of its `projections` and ``lm_head_packed`` for its LM head [D, V] (the
    embedding transposed when tied; only where the head runs in bfloat16, its params
    bfloat16: `models.decoder.Decoder.logits`), split again: the new graphdef and state (every other
    leaf the same array, not a copy). Given a graphdef and params that already carry
    packed kernels (this function's own output), it packs them afresh from the kernels.

    Args:
        graphdef, params: ``nnx.split`` of a ``models.decoder.Decoder``.

    Returns:
        (graphdef, state) with one more bfloat16 leaf per projection and one for the head.
    """
    model = nnx.merge(graphdef, params)
    projs = projections(model)
    head = model.lm_head_weight()
    bf16_head = jnp.promote_types(model.cfg.dtype, head.dtype) == jnp.bfloat16
    packed = _pack_all([*(_flat(p) for p in projs), *([head] if bf16_head else [])])
    for proj, p in zip(projs, packed, strict=False):
        proj.packed = PackedKernel(p)
    if bf16_head:
        model.lm_head_packed = PackedKernel(packed[-1])
    return nnx.split(model)


def packed_bytes(params: nnx.State) -> int:
    """Bytes the `PackedKernel` leaves of `params` hold."""
    leaves = jax.tree.leaves(nnx.filter_state(params, PackedKernel))
    return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
