"""Exact dispatch of tokens to their top-k experts: two ways to compute one result.

Axis legend: N tokens (B·T flattened), D model width, E experts, M one expert's MLP width,
k experts per token. Both compute, for every token, Σ_j w_j · down_e(silu(gate_e(x)) · up_e(x))
over its k chosen experts e = ids_j, with no capacity limit (no token dropped; see
`models.moe` for why).

`dense_dispatch`: every expert runs on every token, and the routing weights (zero off the
top-k) pick the sum: 3·2·N·E·D·M FLOPs and an [N, E, M] activation, E/k times the work of a
sparse dispatch. Simple and fast at tiny E on CPU; the default.

`grouped_dispatch`: the N·k (token, expert) pairs sorted by expert, each expert's rows
multiplied by its weights in one grouped matmul (`jax.lax.ragged_dot`, as in MegaBlocks'
dropless MoE, Gale et al. 2022, arXiv:2211.15841), scattered back with their weights:
3·2·N·k·D·M FLOPs, an [N·k, M] activation, plus a gather and a scatter-add of N·k·D.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_dispatch(
    x: jax.Array, weights: jax.Array, ids: jax.Array, gate: jax.Array, up: jax.Array,
    down: jax.Array,
) -> jax.Array:  # fmt: skip
    """x [N, D], weights [N, k] (x's dtype), ids [N, k] int32, gate / up [E, D, M],
    down [E, M, D] -> [N, D] in x's dtype."""
    E = gate.shape[0]
    mask = jnp.sum(jax.nn.one_hot(ids, E, dtype=x.dtype) * weights[..., None], axis=-2)  # [N, E]
    h = jax.nn.silu(jnp.einsum("nd,edm->nem", x, gate)) * jnp.einsum("nd,edm->nem", x, up)
    out = jnp.einsum("nem,emd->ned", h, down)  # [N, E, D]
    return jnp.einsum("ned,ne->nd", out, mask)


def grouped_dispatch(
    x: jax.Array, weights: jax.Array, ids: jax.Array, gate: jax.Array, up: jax.Array,
    down: jax.Array,
) -> jax.Array:  # fmt: skip
    """The same contract as `dense_dispatch`, computed on the N·k routed pairs only."""
    N, k = ids.shape
    E = gate.shape[0]
    flat = ids.reshape(-1)  # [N·k], pair p = token p // k, its (p % k)-th expert
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    token = order // k  # [N·k]
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # [E] rows per expert
    xs = x[token]  # [N·k, D]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, sizes)) * jax.lax.ragged_dot(xs, up, sizes)
    out = jax.lax.ragged_dot(h, down, sizes)  # [N·k, D]
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((N, x.shape[-1]), x.dtype).at[token].add(out)
