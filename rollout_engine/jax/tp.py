"""A JAX engine replica's mesh and the placement of its params and slots by the rules table.

A replica of d devices with tensor-parallel degree tp runs on a ("data", "tp") mesh of
(d / tp) x tp devices ("tp" innermost, consecutive devices). Its params are placed by the logical
axes each declared (`models.axes`) through the one rules table the trainer uses
(`models.axes.LOGICAL_AXIS_RULES`, `models.sharding.param_sharding`): heads, kv_heads, mlp and
vocab over "tp" (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053); the trainer's "fsdp",
"dp" and "ep" are not axes of this mesh, so every other axis is replicated. The slots (the
decode state's first axis B) are split over "data"; the KV cache ``[B, S, K, H]`` is split over
"data" on B and over "tp" on the KV heads K, so a tp rank keeps only its own heads' cache.
A model whose query or KV heads do not divide by tp is refused (no KV replication when
K < tp: vLLM replicates KV heads there, this engine does not).

Decode and prefill are plain `jax.jit` calls whose shardings follow these inputs (Auto mesh
axes: XLA's SPMD partitioner inserts the all-reduce after each row-parallel matmul).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.axes import axes_of
from models.config import ModelConfig
from models.decoder import Decoder
from models.sharding import check_tp, param_sharding

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


def param_shardings(model_cfg: ModelConfig, mesh: Mesh) -> dict[tuple, NamedSharding]:
    """NamedSharding of every param of a ``Decoder(model_cfg)`` on a replica `mesh`, by its
    flat nnx path: its logical axes through the rules table (`param_sharding` with no size
    floor, so a tiny model's kernels split too; norms declare `norm` -> "fsdp", not an axis
    here, so they stay whole).

    Raises:
        models.sharding.MeshError: "tp" does not divide num_heads or num_kv_heads (named).
        ValueError: an mlp or vocab size "tp" does not divide (named).
    """
    tp = int(mesh.shape["tp"])
    check_tp(model_cfg, tp, name="jax tp")
    abstract = nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(abstract))
    out = {}
    for path, var in flat:
        value = var.get_value()
        axes = axes_of(var) if isinstance(var, nnx.Param) else None
        out[tuple(path)] = param_sharding(axes or (), value.shape, value.dtype, mesh, min_bytes=0)
    return out


def place_params(
    params: nnx.State, shardings: dict[tuple, NamedSharding] | jax.Device
) -> nnx.State:
    """`params` (``nnx.split(decoder)[1]``; host numpy or jax arrays) with each tensor put
    straight into its sharding (`param_shardings`; a single device: all of it there): a host
    array sends each device only its own slice (no whole copy on one device first); an array
    already so placed is referenced, not copied.

    Raises:
        KeyError: a param path `shardings` lacks (named).
    """
    if isinstance(shardings, jax.Device):
        return jax.device_put(params, shardings)
    placed = []
    for path, var in nnx.to_flat_state(params):
        key = tuple(path)
        if key not in shardings:
            raise KeyError(f"param {'.'.join(map(str, key))} has no sharding on this replica")
        placed.append((path, var.replace(jax.device_put(var.get_value(), shardings[key]))))
    return nnx.from_flat_state(placed)


def state_sharding(state: Any, mesh: Mesh) -> Any:
    """Shardings of a `SlotState` on a replica `mesh`: every leaf split over "data" on its slot
    axis B; the KV cache's ``[B, S, K, H]`` leaves also over "tp" on K."""

    def spec(path: tuple, leaf: jax.Array) -> NamedSharding:
        in_cache = any(getattr(p, "name", None) == "cache" for p in path)
        if in_cache and leaf.ndim == 4:
            return NamedSharding(mesh, P("data", None, "tp", None))
        return NamedSharding(mesh, P("data"))

    return jax.tree_util.tree_map_with_path(spec, state)
