"""What one trainer process sends of a version when several send together (fan-in).

With `launch.trainer_processes` P > 1 every trainer process is a sender on the data plane
(`transport.fan_in`). Each turns the params into the engine tensors (HF names and layout, wire
dtype) with JAX, tensor by tensor: the cast and the mapping's layout change run on the global
("dp", "fsdp", "tp") mesh and stay sharded, so no process holds a whole tensor (`engine_arrays`; a
collective: every process calls it at the same point, in the same order). Each result's global
sharding says which device holds which block of the HF tensor
(`jax.sharding.Sharding.devices_indices_map`); every process reads the same map, so all agree
on who sends what without a word: a block held by several processes (replicated over "dp", a
small param FSDP leaves replicated, a tensor the mapping replicated) is sent by the one that was
given the fewest bytes so far, so the sending is balanced. Each process copies its
own blocks to host memory once per version (`local_blocks`): they are what it sends, and what
it re-sends when an engine that restarted must catch up.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mappings.apply import params_to_engine
from mappings.spec import Family
from trainer.publish.host_views import on_one_cpu
from transport.manifest import Box, Manifest, ManifestError, Source


@dataclass
class LocalBlocks:
    """One version as this trainer process holds it for a fan-in push.

    Attributes:
        version: the weight version.
        sources: HF name -> every process's blocks of it, `(process, box)` (the same on every
            process; `Manifest.sources` in tensor order).
        mine: HF name -> this process's blocks in the wire dtype (host copies, or JAX arrays
            on their devices for `transport.jax_transfer`), in the order of its entries in
            `sources` (an empty list when it sends none of the tensor).
    """

    version: int
    sources: dict[str, tuple[Source, ...]] = field(default_factory=dict)
    mine: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        """Bytes of this process's blocks (what it holds of the version)."""
        return sum(int(b.nbytes) for blocks in self.mine.values() for b in blocks)

    def sources_for(self, manifest: Manifest) -> tuple[tuple[Source, ...], ...]:
        """The `Manifest.sources` of these blocks, in `manifest`'s tensor order.

        Raises:
            ManifestError: the manifest names a tensor these blocks lack.
        """
        missing = [t.name for t in manifest.tensors if t.name not in self.sources]
        if missing:
            raise ManifestError(f"version {self.version}: no blocks of {missing[:5]}")
        return tuple(self.sources[t.name] for t in manifest.tensors)


def engine_arrays(
    family: Family,
    cfg: Any,
    params: Mapping[str, Any],
    dtype: str,
    jax_dims: Mapping[str, int] | None = None,
    host_uncast: bool = False,
) -> Iterator[tuple[str, Any]]:
    """(HF name, array in the HF layout) one at a time: each param cast to the wire dtype
    `dtype` in JAX and mapped (`mappings.apply.params_to_engine`), still sharded as JAX
    placed it. With `host_uncast`, a param held whole on one CPU device (or a numpy array)
    comes as a numpy view of its own buffer instead, uncast (the sender's packing copy casts
    it). On several processes a collective: every process iterates it in step."""
    wire = jnp.dtype(dtype)

    def cast(x: Any) -> Any:
        if host_uncast and (isinstance(x, np.ndarray) or on_one_cpu(x)):
            return np.asarray(x)
        return x if x.dtype == wire else jnp.asarray(x).astype(wire)

    yield from params_to_engine(
        family, cfg, params, dict(jax_dims or {}), cast, host=False, contiguous=False
    )


def _box(index: tuple, shape: tuple[int, ...]) -> Box:
    return tuple(tuple(s.indices(d)[:2]) for s, d in zip(index, shape, strict=True))  # type: ignore[misc]


def blocks_of(
    array: Any, process: int, load: dict[int, int] | None = None, on_device: bool = False
) -> tuple[tuple[Source, ...], list[Any]]:
    """Who sends which block of one tensor, and this process's blocks as host copies.

    Args:
        array: a JAX array (global, possibly over several processes) or a numpy array (held
            whole by every process).
        process: this process's index (`jax.process_index()`).
        load: process -> bytes it was given to send so far (updated here); a block that
            several processes hold goes to the one of them with the fewest (ties: the lowest
            index), so replicated tensors (small params under FSDP's `min_bytes`, a mapping's
            replicated output) spread over the processes. Every process passes the same
            history, so all agree. None: the lowest index.
        on_device: keep this process's blocks as copies on the devices that hold them (JAX
            arrays, one device each: what `transport.jax_transfer` serves) instead of host
            copies. A copy either way: the train step donates the buffers the blocks come
            from.

    Returns:
        (sources: `(process, box)` per distinct block, in the order of the devices' (process,
        id); this process's blocks, copied to host memory or on their devices).
    """
    load = {} if load is None else load
    shape = tuple(int(d) for d in array.shape)
    whole = tuple((0, d) for d in shape)
    if not isinstance(array, jax.Array):
        holders: dict[Box, list[int]] = {whole: list(range(jax.process_count()))}
        local = {whole: array}
    else:
        by_device = array.sharding.devices_indices_map(shape)
        holders = {}
        for d in sorted(by_device, key=lambda d: (d.process_index, d.id)):  # type: ignore[attr-defined]
            procs = holders.setdefault(_box(by_device[d], shape), [])
            if int(d.process_index) not in procs:  # type: ignore[attr-defined]
                procs.append(int(d.process_index))  # type: ignore[attr-defined]
        local = {_box(s.index, shape): s.data for s in array.addressable_shards}
    itemsize = int(np.dtype(array.dtype).itemsize)
    sources, mine = [], []
    for box, procs in holders.items():
        owner = min(procs, key=lambda p: (load.get(p, 0), p))
        load[owner] = load.get(owner, 0) + math.prod(b - a for a, b in box) * itemsize
        sources.append((owner, box))
        if owner == process:
            block = local[box]
            mine.append(jnp.array(block, copy=True) if on_device else np.array(block))
    return tuple(sources), mine


def local_blocks(
    tensors: Iterable[tuple[str, Any]], version: int, process: int, on_device: bool = False
) -> LocalBlocks:
    """`blocks_of` every tensor of a version, the sending bytes balanced over the processes
    (see the module docstring); `on_device` keeps the blocks on their devices."""
    out, load = LocalBlocks(version), dict[int, int]()
    for name, array in tensors:
        out.sources[name], out.mine[name] = blocks_of(array, process, load, on_device)
    return out
