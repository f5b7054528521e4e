"""A JAX engine replica's mesh and the placement of its params and slots by the rules table.

A replica of d devices with tensor-parallel degree tp runs on a ("data", "tp") mesh of
(d / tp) x tp devices ("tp" innermost, consecutive devices). Its params are placed by the logical
axes each declared (`models.axes`) through the one rules table the trainer uses
(`models.axes.LOGICAL_AXIS_RULES`, `models.sharding.param_sharding`): heads, kv_heads, mlp and
vocab over "tp" (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053); the trainer's "fsdp",
"dp" and "ep" are not axes of this mesh, so every other axis is replicated. The slots (the
decode state's first axis B) are split over "data"; the KV cache ``[B, K, S, H]`` is split over
"data" on B and over "tp" on the KV heads K, so a tp rank keeps only its own heads' cache.

KV-head replication (as vLLM's `QKVParallelLinear` does): a model with fewer KV heads K than tp
(tp % K == 0) runs as the same model with tp KV heads, each of its K heads repeated r = tp / K
times in place (`np.repeat` on the K axis of the k/v kernels [D, K, H] and biases [K, H]: new
head j is old head j // r). Query head n then reads new head n // (N / tp), whose source is n //
(N / K), the head it reads in the model itself, so the outputs are exact; the replica's
`model_cfg` (`ReplicaLayout.model_cfg`) says num_kv_heads = tp, and its KV cache ``[B, tp, S,
H]`` holds on each tp rank the cache of the one KV head that rank's query heads use. Rank t so
holds head t // r, the layout of `mappings.shards`' "kv" kind (vLLM's ranks). Every params
version is repeated on its way in (`place_params`), so callers keep handing the model's own
layout. Refused (`models.sharding.MeshError`, before any replica starts): tp not dividing
num_heads; K >= tp with tp not dividing K; K < tp with K not dividing tp; K < tp on a model with
one norm over the whole key projection [K·H] (`qk_norm_full`, OLMoE).

Decode and prefill are plain `jax.jit` calls whose shardings follow these inputs (Auto mesh
axes: XLA's SPMD partitioner inserts the all-reduce after each row-parallel matmul).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.axes import axes_of
from models.config import ModelConfig
from models.decoder import Decoder
from models.sharding import MeshError, param_sharding

#: The axes of a replica's mesh: slots over "data", heads / mlp / vocab over "tp".
REPLICA_AXES = ("data", "tp")


def replica_mesh(devices: Sequence[jax.Device], tp: int) -> Mesh:
    """The ("data", "tp") mesh of one replica: ``len(devices) / tp`` x ``tp`` devices, in order.

    Raises:
        ValueError: tp below 1 or not dividing the number of devices (names both).
    """
    if tp < 1 or len(devices) % tp:
        raise ValueError(f"jax tp={tp} does not divide the replica's {len(devices)} devices")
    grid = np.array(list(devices), dtype=object).reshape(len(devices) // tp, tp)
    return Mesh(grid, REPLICA_AXES, axis_types=(AxisType.Auto,) * 2)


def check_replica_tp(model_cfg: ModelConfig, tp: int) -> None:
    """Holds a model against a replica's tensor-parallel degree: "tp" splits the query heads,
    and the KV heads K when K >= tp, or repeats each KV head tp / K times when K < tp
    (module docstring).

    Raises:
        MeshError: tp does not divide num_heads; K >= tp and tp does not divide K; K < tp and
            K does not divide tp; K < tp on a `qk_norm_full` model (each names the numbers).
    """
    n, k = model_cfg.num_heads, model_cfg.num_kv_heads
    if n % tp:
        raise MeshError(f"jax tp={tp} does not divide the model's num_heads={n}")
    if k >= tp and k % tp:
        raise MeshError(f"jax tp={tp} does not divide the model's num_kv_heads={k}")
    if k < tp and tp % k:
        raise MeshError(
            f"jax tp={tp} is not a multiple of the model's num_kv_heads={k}: its KV heads "
            "can be neither split nor replicated evenly over tp"
        )
    if k < tp and model_cfg.qk_norm_full:
        raise MeshError(
            f"jax tp={tp} would replicate the model's num_kv_heads={k}, but its one key norm "
            f"spans the whole [K·H] projection (qk_norm_full): not supported"
        )


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """How a replica holds a model: the config it runs, each param's sharding and the KV-head
    repeat.

    Attributes:
        model_cfg: the model as the replica runs it (num_kv_heads = tp when the model's K < tp,
            else the model's own config); the replica's graphdef and KV cache follow it.
        shardings: NamedSharding of every param by its flat nnx path (`models.axes` rules).
        kv_repeat: r, how many times each of the model's KV heads is held (tp / K, or 1).
        kv_axis: flat path -> the `kv_heads` axis of each param that has one (k/v kernels
            and biases), where `place_params` repeats.
    """

    model_cfg: ModelConfig
    shardings: dict[tuple, NamedSharding]
    kv_repeat: int
    kv_axis: dict[tuple, int]


def replica_layout(model_cfg: ModelConfig, mesh: Mesh) -> ReplicaLayout:
    """The layout of a ``Decoder(model_cfg)`` on a replica `mesh`: its KV heads repeated to tp
    when fewer (module docstring), then each param's logical axes through the rules table
    (`param_sharding` with no size floor, so a tiny model's kernels split too; norms declare
    `norm` -> "fsdp", not an axis here, so they stay whole).

    Raises:
        models.sharding.MeshError: heads "tp" can neither split nor replicate
            (`check_replica_tp`, named).
        ValueError: an mlp or vocab size "tp" does not divide (named).
    """
    tp = int(mesh.shape["tp"])
    check_replica_tp(model_cfg, tp)
    k = model_cfg.num_kv_heads
    run_cfg = dataclasses.replace(model_cfg, num_kv_heads=tp) if k < tp else model_cfg
    abstract = nnx.eval_shape(lambda: Decoder(run_cfg, rngs=nnx.Rngs(0)))
    shardings, kv_axis = {}, {}
    for path, var in nnx.to_flat_state(nnx.state(abstract)):
        value = var.get_value()
        axes = (axes_of(var) if isinstance(var, nnx.Param) else None) or ()
        shardings[tuple(path)] = param_sharding(axes, value.shape, value.dtype, mesh, min_bytes=0)
        if "kv_heads" in axes:
            kv_axis[tuple(path)] = axes.index("kv_heads")
    return ReplicaLayout(run_cfg, shardings, max(tp // k, 1), kv_axis)


def place_params(params: nnx.State, layout: ReplicaLayout | jax.Device) -> nnx.State:
    """`params` (``nnx.split(decoder)[1]`` in the model's own layout; host numpy or jax
    arrays) with each tensor put straight into the replica's `layout` (`replica_layout`; a
    single device: all of it there): a host array sends each device only its own slice (no
    whole copy on one device first); an array already so placed is referenced, not copied.
    With ``layout.kv_repeat`` r > 1, the k/v kernels [D, K, H] and biases [K, H] are first
    repeated r times on their K axis (``np.repeat``, or ``jnp.repeat`` for a jax array: new
    head j = head j // r), so they are new arrays each version; a tensor already holding
    K·r heads (the replica's own layout) is taken as it is.

    Raises:
        KeyError: a param path the layout lacks (named).
        ValueError: a k/v tensor whose K axis is neither the model's K nor K·r (named).
    """
    if isinstance(layout, jax.Device):
        return jax.device_put(params, layout)
    placed = []
    for path, var in nnx.to_flat_state(params):
        key = tuple(path)
        if key not in layout.shardings:
            raise KeyError(f"param {'.'.join(map(str, key))} has no sharding on this replica")
        value = var.get_value()
        if layout.kv_repeat > 1 and key in layout.kv_axis:
            value = _repeat_kv_heads(key, value, layout.kv_axis[key], layout)
        placed.append((path, var.replace(jax.device_put(value, layout.shardings[key]))))
    return nnx.from_flat_state(placed)


def _repeat_kv_heads(key: tuple, value: Any, axis: int, layout: ReplicaLayout) -> Any:
    """`value` with each KV head on `axis` repeated ``layout.kv_repeat`` times (or as it is
    when it holds the replica's heads already).

    Raises:
        ValueError: the K axis is neither the model's K nor the replica's (named)."""
    held = layout.model_cfg.num_kv_heads
    if value.shape[axis] == held:
        return value
    if value.shape[axis] * layout.kv_repeat != held:
        raise ValueError(
            f"param {'.'.join(map(str, key))} of shape {tuple(value.shape)} has "
            f"{value.shape[axis]} KV heads; this replica takes {held // layout.kv_repeat} "
            f"(or {held} repeated)"
        )
    xp = jnp if isinstance(value, jax.Array) else np
    return xp.repeat(value, layout.kv_repeat, axis=axis)


def state_sharding(state: Any, mesh: Mesh) -> Any:
    """Shardings of a `SlotState` on a replica `mesh`: every leaf split over "data" on its slot
    axis B; the KV cache's ``[B, K, S, H]`` leaves also over "tp" on K (K the replica's
    `ReplicaLayout.model_cfg` num_kv_heads: tp or a multiple of it)."""

    def spec(path: tuple, leaf: jax.Array) -> NamedSharding:
        in_cache = any(getattr(p, "name", None) == "cache" for p in path)
        if in_cache and leaf.ndim == 4:
            return NamedSharding(mesh, P("data", "tp", None, None))
        return NamedSharding(mesh, P("data"))

    return jax.tree_util.tree_map_with_path(spec, state)
