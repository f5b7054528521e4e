"""Train-mesh construction and the placement of params by their logical axes.

The mesh has axes ("dp", "fsdp", "ep", "tp") over the devices of every trainer process (one global
mesh under `jax.distributed`: `mesh_devices`, then `make_mesh`). Each param is placed by the
logical axes it declared (`models.axes`) through the one rules table
`models.axes.LOGICAL_AXIS_RULES`: the model width `embed` over "fsdp" (ZeRO-3 style,
Rajbhandari et al. 2020), heads / kv_heads / mlp / vocab over "tp" (Megatron-LM, Shoeybi et
al. 2019), the stacked experts of a mixture-of-experts param over "ep" (expert parallelism,
`models.axes`), everything replicated over "dp". Norm scales declare the axis `norm`: split over
"fsdp" like every param, never over "tp"; small params (every norm scale and bias of a real
model under the default 64 KiB `min_bytes`) are replicated on every device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from models.axes import MESH_AXES, logical_spec
from models.config import ModelConfig

#: The mesh axes the batch's rows are split over.
DATA_AXES = ("dp", "fsdp", "ep")


class MeshError(ValueError):
    """A mesh that does not fit the devices or the model (the message names the numbers)."""


def mesh_devices(per_process: int | None = None) -> list[jax.Device]:
    """The train mesh's devices: the first `per_process` local devices of every process
    (None: all), ordered by process index then device id, so the "fsdp" axis runs through one
    process's devices before the next one's.

    Raises:
        ValueError: a process has fewer than `per_process` devices (names it).
    """
    by_process: dict[int, list[jax.Device]] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    out: list[jax.Device] = []
    for proc in sorted(by_process):
        devs = sorted(by_process[proc], key=lambda d: d.id)
        if per_process is not None and len(devs) < per_process:
            raise ValueError(
                f"process {proc} has {len(devs)} devices, fewer than the {per_process} asked for"
            )
        out.extend(devs[:per_process])
    return out


def make_mesh(
    dp: int = 1,
    fsdp: int = -1,
    devices: Sequence[jax.Device] | None = None,
    *,
    tp: int = 1,
    ep: int = 1,
) -> Mesh:
    """A ("dp", "fsdp", "ep", "tp") mesh over `devices` (default: all, of every process), the
    devices in order with "tp" innermost (a TP group is consecutive devices, one process's
    where it can be), then "ep"; fsdp=-1 takes what dp, ep and tp leave.

    Axis types are Auto, so matmuls that contract over a sharded axis compile.

    Raises:
        MeshError: an axis size below 1, dp · ep · tp does not divide the devices (fsdp=-1),
            or dp · fsdp · ep · tp differs from the number of devices; the message names the
            numbers. (With ep = 1 the messages are the dp · tp ones.)
    """
    devs = list(devices if devices is not None else jax.devices())
    if tp < 1 or dp < 1 or ep < 1:
        raise MeshError(f"dp, ep and tp must be >= 1; got dp={dp}, ep={ep}, tp={tp}")
    if fsdp == -1:
        if len(devs) % (dp * ep * tp):
            named = _product({"dp": dp, "ep": ep, "tp": tp})
            raise MeshError(f"{named} does not divide the {len(devs)} devices")
        fsdp = len(devs) // (dp * ep * tp)
    if dp * fsdp * ep * tp != len(devs):
        named = _product({"dp": dp, "fsdp": fsdp, "ep": ep, "tp": tp})
        raise MeshError(f"{named}, but there are {len(devs)} devices")
    grid = np.array(devs, dtype=object).reshape(dp, fsdp, ep, tp)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _product(sizes: dict[str, int]) -> str:
    """ "dp·tp = 1·3 = 3": the axes and sizes of a mesh product for an error message ("ep"
    left out at 1, so a mesh without expert parallelism reads as before)."""
    shown = {k: v for k, v in sizes.items() if k != "ep" or v > 1}
    return f"{'·'.join(shown)} = {'·'.join(map(str, shown.values()))} = {math.prod(sizes.values())}"


def check_tp(cfg: ModelConfig, tp: int, name: str = "trainer.tp") -> None:
    """Holds a model against a tensor-parallel degree: "tp" splits the query heads and the KV
    heads (`models.axes.LOGICAL_AXIS_RULES`), so it must divide both. `name` is the setting
    the message names (the trainer's, or the JAX engine's "jax tp").

    Raises:
        MeshError: `tp` does not divide num_heads or num_kv_heads (names the numbers).
    """
    for what, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)):
        if n % tp:
            raise MeshError(f"{name}={tp} does not divide the model's {what}={n}")


def check_ep(cfg: ModelConfig, ep: int) -> None:
    """Holds a model against an expert-parallel degree: "ep" splits the stacked experts
    (`models.axes.LOGICAL_AXIS_RULES`), so the model must be a mixture of experts and `ep`
    must divide its num_experts.

    Raises:
        MeshError: ep > 1 on a dense model, or `ep` does not divide num_experts (names them).
    """
    if ep == 1:
        return
    if not cfg.num_experts:
        raise MeshError(
            f"trainer.ep={ep} needs a mixture-of-experts model; {cfg.family} is dense "
            "(num_experts=0)"
        )
    if cfg.num_experts % ep:
        raise MeshError(
            f"trainer.ep={ep} does not divide the model's num_experts={cfg.num_experts}"
        )


def param_sharding(
    axes: Sequence[str],
    shape: Sequence[int],
    dtype: np.dtype | str,
    mesh: Mesh,
    min_bytes: int = 1 << 16,
) -> NamedSharding:
    """NamedSharding of a param with logical `axes`, `shape` and `dtype` on `mesh`: its axes
    through `models.axes.LOGICAL_AXIS_RULES` (`models.axes.logical_spec`).

    A param under `min_bytes` bytes is replicated whatever its axes (a gather per use costs
    more than it saves): at the default 64 KiB that is every norm scale and bias of a real
    model (a [576] fp32 norm is 2.3 KiB); above it a norm scale (axis `norm`) splits over
    "fsdp" and never over "tp".

    Raises:
        ValueError: a dim the mesh axes it maps to do not split evenly (named).
    """
    if math.prod(shape) * np.dtype(dtype).itemsize < min_bytes:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, logical_spec(axes, shape, dict(mesh.shape)))


def place(host: np.ndarray, sharding: NamedSharding, dtype: Any = None) -> jax.Array:
    """A global jax.Array of `sharding` from a host array that every process holds whole
    (the same values on each): each process puts only the slices its own devices hold
    (`jax.make_array_from_callback`), so it works with one process or many. With `dtype`,
    each slice is copied out and cast on its own (a view of a memory-mapped file is then
    read only where this process's slices lie, and never aliased)."""
    if dtype is None:
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: np.array(host[index], dtype=dtype)
    )


def put(x: jax.Array | np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A fresh copy of `x` with `sharding` (never aliasing `x`), for one process or many.

    One process: `jax.device_put` of a host array, a jitted copy of a jax.Array
    (`jax.device_put(..., may_alias=False)` onto a replicated sharding hands back the source's
    own buffer as one of the replicas in JAX 0.10.2, so a donated step would delete the
    source). Several: a host array or an array on this process's devices only (the same values
    on every process) goes through `place`; an array that already spans the processes is
    resharded by a jitted copy.
    """
    if jax.process_count() == 1:
        if isinstance(x, np.ndarray):
            return jax.device_put(x, sharding)
        return jax.jit(lambda a: a.copy(), out_shardings=sharding)(x)
    if isinstance(x, np.ndarray) or x.is_fully_addressable:
        return place(np.asarray(x), sharding)
    return jax.jit(lambda a: a.copy(), out_shardings=sharding)(x)


def host_value(x: jax.Array) -> np.ndarray:
    """The value of a replicated (or fully addressable) array in this process, with one process
    or many (a replica that spans processes is read from this process's first shard).

    Raises:
        ValueError: `x` spans processes and is not replicated (no process holds it whole).
    """
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if not x.sharding.is_fully_replicated:
        raise ValueError(f"array {x.shape} is split over processes: gather it first")
    return np.asarray(x.addressable_data(0))
