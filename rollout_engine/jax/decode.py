"""One decode step over all slots, and the compiled loop that runs steps until a sample finishes.

Legend: B slots, V vocabulary, C completion capacity.

After the seed write-up "Async RL in Pure JAX" (``decode`` and ``_decode_single_loop``): the
state is donated so the KV cache is updated in place; the loop returns to the host as soon as any
slot finishes (or after ``max_steps``, a safe point for weight updates), and the host collects
every finished slot at once rather than one per return.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import Decoder
from models.kernels.scope import scoped
from models.kv_cache import KVCache
from models.routing import forward_with_routing
from rollout_engine.jax.sampling import RowSampling, SamplingConfig, sample_rows
from rollout_engine.jax.state import SlotState
from rollout_engine.jax.stops import RUNNING, StopConfig, decide


def step_keys(key_data: jax.Array, index: jax.Array) -> jax.Array:
    """``[B]`` typed keys drawing token number ``index[b]`` (0-based) of each sample.

    Args:
        key_data: ``[B, 2]`` uint32 raw sample keys. index: ``[B]`` int32.
    """
    keys = jax.random.wrap_key_data(key_data)
    return jax.vmap(jax.random.fold_in)(keys, index)


def decode_step(
    model: Decoder,
    state: SlotState,
    sampling: SamplingConfig,
    stops: StopConfig,
    kv_len: int | None = None,
) -> SlotState:
    """Feed each slot's last token, sample the next one, apply the stop rules, write it out.

    Slots that are inactive or finished are computed (the batch is static) but left unchanged,
    except for a harmless cache write at their frozen position.

    Args:
        model: a ``models.decoder.Decoder`` (``model(tokens, positions, cache)``); a
            mixture-of-experts one records each running slot's routes in ``out_routes``.
        state: the slot state, with each slot's temperature / top-k / top-p. sampling: static;
            its `truncates` compiles the top-k / top-p filters in. stops: static settings.
        kv_len: static bound of the attention to cache slots [0, kv_len) (every running
            slot's position must be below it), or None for all S slots.

    Returns:
        The next state.
    """
    running = state.active & ~state.finished
    rows = jnp.arange(state.num_slots)
    out_routes = state.out_routes
    with jax.named_scope("forward"):
        # Idle slots feed token 0: a forced stop id outside the vocabulary would embed as NaN,
        # land in the slot's KV cache and poison its next sample (0 · NaN in attention).
        feed = jnp.where(running, state.last, 0)[:, None]  # [B, 1]
        if out_routes.shape[1]:  # a MoE model: record the pass over completion token gen_len-1
            local = nnx.merge(*nnx.split(model))  # recording mutates: a copy at this trace
            logits, cache, record = forward_with_routing(
                local, feed, state.pos[:, None], state.cache, kv_len
            )  # [B, 1, V]
            at = jnp.where(running, state.gen_len - 1, out_routes.shape[1])  # idle: dropped
            ids = record.expert_ids[:, 0].astype(out_routes.dtype)  # [B, L, k]
            out_routes = out_routes.at[rows, at].set(ids, mode="drop")
        else:
            logits, cache = model(feed, state.pos[:, None], state.cache, kv_len)  # [B, 1, V]
    assert cache is not None  # a forward given a cache returns it updated
    with jax.named_scope("sample"):
        per_slot = RowSampling(state.temperature, state.top_k, state.top_p)
        keys = step_keys(state.key_data, state.gen_len)
        tokens, logprobs = sample_rows(logits[:, 0], keys, per_slot, truncate=sampling.truncates)
    with jax.named_scope("stops"):
        d = decide(
            tokens,
            logprobs,
            gen_len=state.gen_len,
            max_new=state.max_new,
            finished=~running,
            think_done=state.think_done,
            history=state.history,
            cfg=stops,
        )
    col = jnp.where(running, state.gen_len, state.capacity)  # out of range -> dropped
    ended = running & (d.reason != RUNNING)
    return SlotState(
        cache=cache,
        last=jnp.where(running, d.tokens, state.last),
        pos=state.pos + running,
        gen_len=state.gen_len + running,
        max_new=state.max_new,
        out_tokens=state.out_tokens.at[rows, col].set(d.tokens, mode="drop"),
        out_logprobs=state.out_logprobs.at[rows, col].set(d.logprobs, mode="drop"),
        out_forced=state.out_forced.at[rows, col].set(d.forced, mode="drop"),
        finished=state.finished | ended,
        reason=jnp.where(ended, d.reason, state.reason),
        think_done=jnp.where(running, d.think_done, state.think_done),
        history=jnp.where(running[:, None], d.history, state.history),
        key_data=state.key_data,
        active=state.active,
        temperature=state.temperature,
        top_k=state.top_k,
        top_p=state.top_p,
        out_routes=out_routes,
    )


def _loop(
    graphdef: nnx.GraphDef,
    sampling: SamplingConfig,
    stops: StopConfig,
    params: nnx.State,
    state: SlotState,
    max_steps: jax.Array,
    kv_len: int | None = None,
    rows: int | None = None,
) -> tuple[SlotState, jax.Array]:
    if rows is not None and rows < state.num_slots:  # run the first `rows` slots only
        # the per-slot fields' first rows are copied out and back (small); the KV cache
        # stays whole: the layers write and read its first `rows` rows in place
        def fields(s: SlotState) -> SlotState:
            return dataclasses.replace(s, cache=KVCache((), ()))

        part = dataclasses.replace(jax.tree.map(lambda x: x[:rows], fields(state)),
                                   cache=state.cache)  # fmt: skip
        part, steps = _loop(graphdef, sampling, stops, params, part, max_steps, kv_len)
        merged = jax.tree.map(
            lambda full, p: jax.lax.dynamic_update_slice_in_dim(full, p, 0, axis=0),
            fields(state),
            fields(part),
        )  # in place: the state is donated
        return dataclasses.replace(merged, cache=part.cache), steps
    model = nnx.merge(graphdef, params)

    def cond(carry: tuple[SlotState, jax.Array]) -> jax.Array:
        s, n = carry
        live = s.active & ~s.finished
        waiting = jnp.any(s.active & s.finished)
        fits = True if kv_len is None else jnp.all(jnp.where(live, s.pos < kv_len, True))
        return (n < max_steps) & ~waiting & jnp.any(live) & fits

    def body(carry: tuple[SlotState, jax.Array]) -> tuple[SlotState, jax.Array]:
        s, n = carry
        return decode_step(model, s, sampling, stops, kv_len), n + 1

    return jax.lax.while_loop(cond, body, (state, jnp.int32(0)))


def make_decode_loop(
    graphdef: nnx.GraphDef,
    sampling: SamplingConfig,
    stops: StopConfig,
    native_attention: bool = False,
):
    """Compile ``loop(params, state, max_steps, kv_len=None, rows=None) -> (state, steps)``;
    ``state`` is donated. With `native_attention` (a one-device replica) the loop is traced
    inside `models.kernels.scope.native_scope`: a step's attention over a bits cache and its
    embedding lookup are the native CPU kernels where they are available
    (`models.kernels.decode_attention`, `models.kernels.embed_rows`), else XLA's.

    The loop runs decode steps while no active slot is finished, some slot is running, fewer
    than ``max_steps`` (int32 scalar) steps ran and, with ``kv_len`` (static int: one compiled
    loop per value), every running slot's position is below it (each step's attention then
    reads only ``kv_len`` cache slots); ``steps`` is the int32 number of steps taken. With
    ``rows`` (static int < B: one compiled loop per value) only slots [0, rows) are decoded,
    every slot from ``rows`` on must be empty: their per-slot fields are copied out of the
    state once per call and written back in place after the loop, while the layers write
    and read the first ``rows`` rows of the whole KV cache in place (copying a [rows, K, S, H]
    slice of every layer out and back cost about 0.2 s per call at SmolLM2, 64 of 128 slots
    and S = 310), so a step computes ``rows`` rows, not B (the batcher's ``row_bucket``).
    Shardings follow the inputs (a batch-sharded state gives a data-parallel loop; ``rows``
    is for an unsharded state).
    """

    def loop(params, state, max_steps, kv_len=None, rows=None):  # type: ignore[no-untyped-def]
        return _loop(graphdef, sampling, stops, params, state, max_steps, kv_len, rows)

    loop = scoped(loop, native_attention)  # the scope is read while the loop is traced
    return jax.jit(loop, donate_argnums=(1,), static_argnames=("kv_len", "rows"))
