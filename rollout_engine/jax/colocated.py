"""The same-program weight path: trainer and JAX engine in one JAX program on disjoint devices.

When the trainer (say FSDP over devices 0-3) and the engine's replicas (devices 4-7) live in one
process, a new version moves from the trainer's sharding to the engine's by device-to-device
copies (ICI on TPUs; on CPUs the same code over host devices), with no host round trip, no
mapping to HF names and no transport.

A plain ``jax.device_put`` between disjoint device sets is device to device only when every
destination shard already exists as a source shard (same slices); otherwise (FSDP shards to a
replicated engine copy) JAX 0.10 silently gathers the array on the host
(``array.shard_sharded_device_array_slow_path`` falls back to ``x._value``). So for each such
param, every distinct trainer shard is copied to the first engine device and written into place
there by one compiled call (the cast to the engine dtype included), and the engine's other
devices copy the whole array from that one. The whole copy runs under JAX's transfer guards set
to ``disallow_explicit``, so any host transfer raises instead of passing silently. (Gathering
on the trainer mesh first works too, but writes the whole param once per trainer device:
measured here on SmolLM2-135M, 0.7 to 1.1 s per push against 0.3 to 0.5 s this way.)

``copy_to_engine`` makes the copy for one replica's layout (read from the params it serves);
``ColocatedPublisher.push(model, version)`` has the signature of
``trainer.publish.WeightPublisher.push``, so the trainer loop uses it unchanged: it copies,
hands the copy to the engine (``JaxBackend.update_params`` or ``JaxEngine.update_weights``; each
replica switches at its next safe point, referencing the copy's buffers, and stamps the new
version on every sample) and waits until every replica serves the version.

The copy never aliases the trainer's buffers (``may_alias=False``): the train step donates its
state, so an aliased engine param would be deleted under the engine. No extra trainer memory;
the engine's first device holds the pieces of a param while it is assembled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Sharding

from rollout_engine.jax.engine import JaxEngine
from trainer.models.params import flat_params, path_str


@dataclasses.dataclass(frozen=True)
class ColocatedPushStats:
    """One in-process push.

    Attributes:
        version: the version every replica now serves.
        num_bytes: bytes copied to the engine (in the engine's dtype, one copy).
        num_tensors: params copied.
        copy_s: the device-to-device copy (until every buffer is ready).
        wait_s: copy end -> every replica reached a safe point and serves ``version``.
        seconds: the whole push.
    """

    version: int
    num_bytes: int
    num_tensors: int
    copy_s: float
    wait_s: float
    seconds: float

    @property
    def gb_per_s(self) -> float:
        """Copied GB/s (1e9 bytes) of the copy alone."""
        return self.num_bytes / max(self.copy_s, 1e-9) / 1e9


def _shard_keys(sharding: Sharding, shape: tuple[int, ...]) -> set[tuple]:
    """The slices every device of ``sharding`` holds (see ``_index_key``)."""
    return {_index_key(i, shape) for i in sharding.devices_indices_map(shape).values()}


def needs_gather(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> bool:
    """True when some shard of ``dst`` is not a shard of ``src``: ``jax.device_put`` would then
    pass through the host, so the array must be gathered on its own devices first."""
    return not _shard_keys(dst, shape) <= _shard_keys(src, shape)


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    """A shard's slices as hashable ``(start, stop, step)`` tuples."""
    return tuple(sl.indices(n) for sl, n in zip(index, shape, strict=True))


@functools.lru_cache(maxsize=256)
def _assemble_fn(shape: tuple[int, ...], keys: tuple[tuple, ...], dtype: np.dtype):
    """A compiled ``pieces -> [shape] dtype`` that writes each piece at its slices ``keys``."""

    def build(pieces: list[jax.Array]) -> jax.Array:
        out = jnp.zeros(shape, dtype)
        for key, piece in zip(keys, pieces, strict=True):
            out = out.at[tuple(slice(*k) for k in key)].set(piece.astype(dtype))
        return out

    return jax.jit(build)


def _assemble_on(x: jax.Array, device: jax.Device, dtype: np.dtype) -> jax.Array:
    """The whole of ``x`` (cast to ``dtype``) on ``device``: each distinct shard is copied there
    (device to device) and written into place by one compiled call."""
    shape = tuple(x.shape)
    shards: dict[tuple, jax.Array] = {}
    for shard in x.addressable_shards:
        shards.setdefault(_index_key(shard.index, shape), shard.data)
    keys = tuple(shards)
    pieces = [jax.device_put(shards[k], device) for k in keys]
    return _assemble_fn(shape, keys, np.dtype(dtype))(pieces)


def _on_source_devices(x: jax.Array, dst: Sharding, dtype: np.dtype) -> jax.Array:
    """``x`` cast to ``dtype``; where ``dst`` needs whole-array shards ``x`` lacks, the whole
    array assembled on the first device of ``dst`` (whose other devices copy it from there)."""
    if needs_gather(x.sharding, dst, tuple(x.shape)):
        first = min(dst.device_set, key=lambda d: d.id)  # type: ignore[attr-defined]
        return _assemble_on(x, first, dtype)
    return x if x.dtype == dtype else x.astype(dtype)


@contextlib.contextmanager
def _no_host_transfers() -> Iterator[None]:
    """Any transfer between host and device, explicit or not, raises inside."""
    with (
        jax.transfer_guard_device_to_host("disallow_explicit"),
        jax.transfer_guard_host_to_device("disallow_explicit"),
    ):
        yield


def copy_to_engine(params: Mapping[str, jax.Array], template: nnx.State) -> nnx.State:
    """Copy flat trainer params into the layout of ``template`` (device to device).

    Args:
        params: flat params by dot path (``trainer.models.params.flat_params``): committed
            ``jax.Array``s with any sharding, e.g. FSDP over the trainer mesh.
        template: the ``nnx.State`` an engine replica serves now; each leaf gives the target
            shape, dtype and sharding.

    Returns:
        An ``nnx.State`` like ``template`` whose arrays are fresh buffers on the template's
        devices (never aliases of ``params``), ready (the copy has completed).

    Raises:
        KeyError: a param of the template that ``params`` lacks, or extra params (named).
        ValueError: a shape that differs from the template's (expected vs got).
        TypeError: a param that is not a ``jax.Array`` (host arrays are refused).
        jax.errors.JaxRuntimeError: (JAX's transfer guard) the copy would pass the host.
    """
    flat = nnx.to_flat_state(template)
    names = [path_str(path) for path, _ in flat]
    missing = [n for n in names if n not in params]
    extra = sorted(set(params) - set(names))
    if missing or extra:
        raise KeyError(f"params do not match the engine's: missing {missing}, unexpected {extra}")
    sources, shardings = [], []
    for (_, var), name in zip(flat, names, strict=True):
        want, x = var.get_value(), params[name]
        if not isinstance(x, jax.Array):
            raise TypeError(f"param {name}: expected a jax.Array, got {type(x).__name__}")
        if tuple(x.shape) != tuple(want.shape):
            raise ValueError(f"param {name}: expected shape {want.shape}, got {tuple(x.shape)}")
        sources.append(x)
        shardings.append(want.sharding)
    copied = []
    with _no_host_transfers():
        for x, (_, var), dst in zip(sources, flat, shardings, strict=True):
            src = _on_source_devices(x, dst, var.get_value().dtype)
            copied.append(jax.device_put(src, dst, may_alias=src is not x))
        jax.block_until_ready(copied)
    filled = [(path, var.replace(a)) for (path, var), a in zip(flat, copied, strict=True)]
    return nnx.from_flat_state(filled)


def _engine_of(target: Any) -> JaxEngine:
    engine = target if isinstance(target, JaxEngine) else getattr(target, "engine", None)
    if not isinstance(engine, JaxEngine):
        raise TypeError(
            f"expected a JaxEngine or a started JaxBackend, got {type(target).__name__} "
            f"(engine: {type(engine).__name__})"
        )
    return engine


class ColocatedPublisher:
    """Pushes trainer params to a JAX engine of the same program (see the module docstring).

    Args:
        target: a ``JaxEngine``, or a started ``JaxBackend`` (its ``update_params`` is called,
            so the backend's ``weight_version`` follows).
        timeout_s: how long ``push`` waits for every replica to reach a safe point.
        poll_s: the wait's polling interval in seconds.
    """

    def __init__(self, target: Any, *, timeout_s: float = 120.0, poll_s: float = 0.005) -> None:
        _engine_of(target)  # fail early on a wrong target
        self.target = target
        self.timeout_s = timeout_s
        self.poll_s = poll_s

    def push(self, model_or_params: Any, version: int) -> ColocatedPushStats:
        """Make ``version`` current on every replica and return once each one serves it.

        Args:
            model_or_params: a ``Decoder`` or its flat params by dot path, on the trainer's
                devices (any sharding).
            version: the new version; above every replica's current one.

        Raises:
            ValueError: ``version`` not above a replica's current version.
            TimeoutError: a replica did not reach a safe point within ``timeout_s``.
            KeyError, TypeError, ValueError, jax.errors.JaxRuntimeError: see
                :func:`copy_to_engine` (the last also when a replica's copy would pass the host).
        """
        engine = _engine_of(self.target)
        current = max(b.version for b in engine.replicas)
        if version <= current:
            raise ValueError(f"version must be above the engine's {current}, got {version}")
        params = model_or_params
        if not isinstance(params, Mapping):
            params = flat_params(params)
        t0 = time.perf_counter()
        state = copy_to_engine(params, engine.replicas[0].params)
        t1 = time.perf_counter()
        with _no_host_transfers():  # replicas past the first copy from the first one
            if hasattr(self.target, "update_params"):
                self.target.update_params(state, version)
            else:
                engine.update_weights(state, version)
        deadline = time.monotonic() + self.timeout_s
        while any(b.version < version for b in engine.replicas):
            if time.monotonic() > deadline:
                late = [i for i, b in enumerate(engine.replicas) if b.version < version]
                raise TimeoutError(
                    f"replicas {late} did not serve version {version} within {self.timeout_s} s"
                )
            time.sleep(self.poll_s)
        t2 = time.perf_counter()
        leaves = jax.tree.leaves(state)
        num_bytes = sum(x.nbytes for x in leaves)
        return ColocatedPushStats(version, num_bytes, len(leaves), t1 - t0, t2 - t1, t2 - t0)

    def close(self) -> None:
        """Nothing to release (kept for the publisher interface)."""
