"""Train-mesh construction and the FSDP placement of params.

The mesh has axes ("dp", "fsdp"); params are sharded along one dimension over "fsdp"
(ZeRO-3 style, Rajbhandari et al. 2020) and replicated over "dp". Small params (norm
scales, biases: below `min_bytes`) are replicated, as in the pure-JAX async RL write-up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA_AXES = ("dp", "fsdp")


def make_mesh(dp: int = 1, fsdp: int = -1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("dp", "fsdp") mesh over `devices` (default: all); fsdp=-1 takes what dp leaves.

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
