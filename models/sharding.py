"""Train-mesh construction and the FSDP placement of params.

The mesh has axes ("dp", "fsdp") over the devices of every trainer process (one global mesh
under `jax.distributed`: `mesh_devices`, then `make_mesh`); params are sharded along one
dimension over "fsdp" (ZeRO-3 style, Rajbhandari et al. 2020) and replicated over "dp". Small
params (norm scales, biases: below `min_bytes`) are replicated, as in the pure-JAX async RL
write-up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA_AXES = ("dp", "fsdp")


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


def make_mesh(dp: int = 1, fsdp: int = -1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("dp", "fsdp") mesh over `devices` (default: all, of every process); fsdp=-1 takes
    what dp leaves.

    Axis types are Auto, so matmuls that contract over a sharded axis compile.

    Raises:
        ValueError: dp · fsdp differs from the number of devices.
    """
    devs = list(devices if devices is not None else jax.devices())
    if fsdp == -1:
        if len(devs) % dp:
            raise ValueError(f"dp={dp} does not divide the {len(devs)} devices")
        fsdp = len(devs) // dp
    if dp * fsdp != len(devs):
        raise ValueError(f"dp·fsdp = {dp}·{fsdp} = {dp * fsdp}, but there are {len(devs)} devices")
    grid = np.array(devs, dtype=object).reshape(dp, fsdp)
    return Mesh(grid, DATA_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def fsdp_spec(shape: Sequence[int], itemsize: int, fsdp: int, min_bytes: int) -> PartitionSpec:
    """The PartitionSpec of one param: its largest dim divisible by `fsdp` over "fsdp".

    Replicated when fsdp == 1, when the param is under `min_bytes` bytes, or when no dim
    divides evenly.
    """
    if fsdp == 1 or math.prod(shape) * itemsize < min_bytes:
        return PartitionSpec()
    candidates = [d for d in range(len(shape)) if shape[d] % fsdp == 0]
    if not candidates:
        return PartitionSpec()
    dim = max(candidates, key=lambda d: shape[d])
    return PartitionSpec(*[("fsdp" if d == dim else None) for d in range(len(shape))])


def param_sharding(
    shape: Sequence[int], dtype: np.dtype | str, mesh: Mesh, min_bytes: int = 1 << 16
) -> NamedSharding:
    """NamedSharding of a param of `shape`/`dtype` on `mesh` (see fsdp_spec)."""
    itemsize = np.dtype(dtype).itemsize
    return NamedSharding(mesh, fsdp_spec(shape, itemsize, mesh.shape["fsdp"], min_bytes))


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

    One process: `jax.device_put`. Several: a host array or an array on this process's
    devices only (the same values on every process) goes through `place`; an array that
    already spans the processes is resharded by a jitted copy.
    """
    if jax.process_count() == 1:
        return jax.device_put(x, sharding, may_alias=False)
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
