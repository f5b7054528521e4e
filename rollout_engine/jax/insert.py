"""Slot substitution: put prefilled samples into free slots, sampling their first token.

Legend: n samples inserted (padded to a power of two), B slots, T prompt bucket, V vocabulary.

The seed write-up "Async RL in Pure JAX" substitutes one row per call and, in its data-parallel
variant, wraps the substitution in ``shard_map`` so that only the device owning the slot writes
(XLA otherwise all-gathers the cache). Here n rows go in at once; padding entries carry the slot
index B, which every scatter drops (``mode="drop"``), and in the sharded variant each device maps
the global slot to its local block and drops the slots it does not own, so nothing moves between
devices.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models.kv_cache import to_storage
from rollout_engine.jax.decode import step_keys
from rollout_engine.jax.prefill import PrefillBatch
from rollout_engine.jax.sampling import RowSampling, SamplingConfig, sample_rows
from rollout_engine.jax.state import SlotState
from rollout_engine.jax.stops import RUNNING, StopConfig, decide


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotUpdate:
    """The n rows to write: ``k``/``v`` per layer ``[n, K, T, H]``, then one value per field of
    :class:`SlotState` (``[n]`` or ``[n, C]`` / ``[n, M]`` / ``[n, 2]``); ``positions``
    ``[n, T]`` int32 the slot positions of the T cache entries (None: ``[0, T)``)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    rows: SlotState  # with an empty cache (k = v = ())
    positions: jax.Array | None = None


def first_tokens(
    pre: PrefillBatch,
    rows: jax.Array,
    key_data: jax.Array,
    max_new: jax.Array,
    capacity: int,
    marker_len: int,
    sampling: SamplingConfig,
    stops: StopConfig,
    row_sampling: RowSampling | None = None,
) -> SlotUpdate:
    """Sample each inserted sample's first completion token from its prompt's prefill logits.

    Args:
        pre: the prefilled prompt batch. rows: ``[n]`` int32 prompt row of each sample.
        key_data: ``[n, 2]`` uint32 sample keys. max_new: ``[n]`` int32 completion limits.
        capacity: C. marker_len: M. sampling, stops: static settings (`sampling.truncates`
            compiles the top-k / top-p filters in). row_sampling: ``[n]`` settings of each
            sample's request; None: every sample with `sampling`.

    Returns:
        The rows to write; a sample whose first token already ends it is marked finished.
    """
    n = rows.shape[0]
    zero = jnp.zeros(n, jnp.int32)
    if row_sampling is None:
        row_sampling = RowSampling.filled(n, sampling)
    tokens, logprobs = sample_rows(
        pre.last_logits[rows], step_keys(key_data, zero), row_sampling, truncate=sampling.truncates
    )
    d = decide(
        tokens,
        logprobs,
        gen_len=zero,
        max_new=max_new,
        finished=jnp.zeros(n, bool),
        think_done=jnp.zeros(n, bool),
        history=jnp.full((n, marker_len), -1, jnp.int32),
        cfg=stops,
    )
    out_t = jnp.full((n, capacity), stops.pad_id, jnp.int32).at[:, 0].set(d.tokens)
    out_lp = jnp.zeros((n, capacity), jnp.float32).at[:, 0].set(d.logprobs)
    out_forced = jnp.zeros((n, capacity), bool).at[:, 0].set(d.forced)
    new = SlotState(
        cache=type(pre.cache)(k=(), v=()),
        last=d.tokens,
        pos=pre.lengths[rows],
        gen_len=jnp.ones(n, jnp.int32),
        max_new=max_new,
        out_tokens=out_t,
        out_logprobs=out_lp,
        out_forced=out_forced,
        finished=d.reason != RUNNING,
        reason=d.reason,
        think_done=d.think_done,
        history=d.history,
        key_data=key_data,
        active=jnp.ones(n, bool),
        temperature=row_sampling.temperature,
        top_k=row_sampling.top_k,
        top_p=row_sampling.top_p,
        out_routes=jnp.zeros((n, 0), jnp.int16),  # not written: decode fills it
    )
    return SlotUpdate(
        k=tuple(k[rows] for k in pre.cache.k),
        v=tuple(v[rows] for v in pre.cache.v),
        rows=new,
        positions=None if pre.positions is None else pre.positions[rows],
    )


def scatter_rows(state: SlotState, upd: SlotUpdate, slots: jax.Array) -> SlotState:
    """Write ``upd`` into ``state`` at ``slots [n]``; out-of-range slots are dropped.

    The prompt's T cache positions overwrite positions ``[0, T)`` of the slot (or, with
    ``upd.positions``, the window of an extension: only those positions, the slot's earlier
    cache kept); positions beyond the prompt hold garbage that decode overwrites before it is
    attended.
    """
    t = upd.k[0].shape[2] if upd.k else 0
    if t > state.max_len:
        raise ValueError(f"prompt bucket {t} exceeds the slot cache length {state.max_len}")

    def put(dst: jax.Array, src: jax.Array) -> jax.Array:
        return dst.at[slots].set(src.astype(dst.dtype), mode="drop")

    def put_kv(dst: jax.Array, src: jax.Array) -> jax.Array:
        src = to_storage(src, dst)  # a bits cache (uint16) takes the bfloat16 bits
        if upd.positions is not None:  # [n, T] window; padding positions (S) are dropped
            # advanced indices around a slice index [n, T] + [K, H]: src [n, K, T, H] swapped
            return dst.at[slots[:, None], :, upd.positions].set(
                jnp.swapaxes(src, 1, 2), mode="drop"
            )
        return dst.at[slots, :, :t].set(src, mode="drop")

    cache = type(state.cache)(
        k=tuple(put_kv(d, s) for d, s in zip(state.cache.k, upd.k, strict=True)),
        v=tuple(put_kv(d, s) for d, s in zip(state.cache.v, upd.v, strict=True)),
    )
    fields = {
        f.name: put(getattr(state, f.name), getattr(upd.rows, f.name))
        for f in dataclasses.fields(SlotState)
        if f.name not in ("cache", "out_routes")
    }
    return SlotState(cache=cache, out_routes=state.out_routes, **fields)


def sharded_scatter_rows(mesh: Mesh, axis: str):
    """``scatter_rows`` for a state whose slot axis is sharded over ``mesh`` axis ``axis``.

    Each device receives the (replicated) update and the global slot indices, converts them to
    its local block ``[i·B_local, (i+1)·B_local)`` and drops the rest: only the owning device
    writes, and no cache row crosses devices.
    """

    def local(state: SlotState, upd: SlotUpdate, slots: jax.Array) -> SlotState:
        b_local = state.num_slots
        start = jax.lax.axis_index(axis) * b_local
        idx = slots - start
        idx = jnp.where((idx >= 0) & (idx < b_local), idx, b_local)
        return scatter_rows(state, upd, idx)

    def run(state: SlotState, upd: SlotUpdate, slots: jax.Array) -> SlotState:
        state_spec = jax.tree.map(lambda _: P(axis), state)
        upd_spec = jax.tree.map(lambda _: P(), upd)
        fn = jax.shard_map(  # manual over `axis` only: a "tp" axis stays XLA's (Auto)
            local,
            mesh=mesh,
            in_specs=(state_spec, upd_spec, P()),
            out_specs=state_spec,
            axis_names={axis},
        )
        return fn(state, upd, slots)

    return run


def _insert(
    scatter, capacity, marker_len, sampling, stops, state, pre, slots, rows, keys, max_new,
    row_sampling=None,
):  # fmt: skip
    upd = first_tokens(
        pre, rows, keys, max_new, capacity, marker_len, sampling, stops, row_sampling
    )
    return scatter(state, upd, slots)


def make_insert(
    *,
    capacity: int,
    marker_len: int,
    sampling: SamplingConfig,
    stops: StopConfig,
    mesh: Mesh | None = None,
    axis: str = "data",
):
    """Compile ``insert(state, pre, slots, rows, key_data, max_new, row_sampling=None) -> state``
    (state donated).

    Args:
        capacity, marker_len: C and M of the state. sampling, stops: static settings.
        mesh, axis: when given, the state's slot axis is sharded over ``mesh[axis]`` and the
            substitution runs under ``shard_map`` (only the owning device writes).

    The call's arrays: ``slots [n]`` int32 (``B`` for padding), ``rows [n]`` int32 prompt rows
    of ``pre``, ``key_data [n, 2]`` uint32, ``max_new [n]`` int32, ``row_sampling`` a
    `RowSampling` of ``[n]`` arrays (None: every sample with `sampling`).
    """
    scatter = scatter_rows if mesh is None else sharded_scatter_rows(mesh, axis)
    fn = partial(_insert, scatter, capacity, marker_len, sampling, stops)
    return jax.jit(fn, donate_argnums=(0,))
