"""The in-flight decode state of one replica: B slots, each holding one sample or nothing.

Legend: B slots, S cache slots (positions), C completion capacity (tokens), M end-of-think marker
length. Everything lives on the replica's devices and is donated to each compiled call, so the KV
cache is updated in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.kv_cache import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """Per-slot decode state (a pytree; every leaf has the slot axis B first).

    Attributes:
        cache: the KV cache, per layer ``[B, K, S, H]`` (head-major, `models.kv_cache`);
            slot index == absolute position.
        last: ``[B]`` int32, the last emitted token, fed at the next step (not yet in the cache).
        pos: ``[B]`` int32, the position of ``last`` (prompt length + completion tokens - 1).
        gen_len: ``[B]`` int32, completion tokens emitted so far.
        max_new: ``[B]`` int32, completion tokens allowed (the sample ends with reason "length"
            at token number ``max_new`` unless it emitted an EOS first).
        out_tokens: ``[B, C]`` int32 and out_logprobs ``[B, C]`` float32, the completion so far.
        out_forced: ``[B, C]`` bool, completion tokens the engine wrote without sampling them
            (the end-of-think phrase); they are kept out of the loss.
        finished: ``[B]`` bool, the sample ended (by EOS or length) and waits to be collected.
        reason: ``[B]`` int32, see ``stops.RUNNING / STOP_EOS / STOP_LENGTH``.
        think_done: ``[B]`` bool; history ``[B, M]`` int32, the last M emitted tokens.
        key_data: ``[B, 2]`` uint32, the raw PRNG key of each sample (token g is drawn with
            ``fold_in(key, g)``, so a draw does not depend on the slot or replica).
        active: ``[B]`` bool, the slot holds a sample (running or finished, not yet collected).
        temperature: ``[B]`` float32 (0: greedy), top_k ``[B]`` int32 (<= 0: off), top_p ``[B]``
            float32 (>= 1: off): the sampling of each slot's request (`sampling.RowSampling`).
        out_routes: ``[B, C, L, k]`` int16, the experts each MoE layer chose in the decode
            pass over completion token j (routing replay; written by `decode.decode_step`,
            never by an insertion, so a row is valid up to the sample's gen_len - 1); a dense
            model's is ``[B, 0, 0, 0]`` and nothing is recorded.
    """

    cache: KVCache
    last: jax.Array
    pos: jax.Array
    gen_len: jax.Array
    max_new: jax.Array
    out_tokens: jax.Array
    out_logprobs: jax.Array
    out_forced: jax.Array
    finished: jax.Array
    reason: jax.Array
    think_done: jax.Array
    history: jax.Array
    key_data: jax.Array
    active: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    out_routes: jax.Array

    @property
    def num_slots(self) -> int:
        """B, the number of slots."""
        return int(self.last.shape[0])

    @property
    def capacity(self) -> int:
        """C, the most completion tokens a slot can hold."""
        return int(self.out_tokens.shape[1])

    @property
    def max_len(self) -> int:
        """S, the number of cache positions."""
        return int(self.cache.k[0].shape[2])


def init_slots(
    cfg: ModelConfig,
    *,
    num_slots: int,
    max_len: int,
    capacity: int,
    marker_len: int,
    pad_id: int,
    cache_dtype: str | None = None,
    kv_bits: bool = False,
) -> SlotState:
    """Empty state: every slot inactive, the cache zeroed.

    Args:
        cfg: the model, for the cache shape (``num_layers``, ``num_kv_heads``, ``head_dim``).
        num_slots: B. max_len: S, prompt plus completion positions per slot.
        capacity: C, most completion tokens. marker_len: M. pad_id: fills ``out_tokens``.
        cache_dtype: KV dtype, defaults to ``cfg.dtype``. kv_bits: hold a bfloat16 cache as
            uint16 bit patterns (`models.kv_cache`: in-place writes on XLA's CPU backend).

    Raises:
        ValueError: a size below 1.
    """
    for name, value in (("num_slots", num_slots), ("max_len", max_len), ("capacity", capacity)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    b = num_slots

    def zeros() -> jax.Array:  # distinct buffers: the state is donated leaf by leaf
        return jnp.zeros(b, jnp.int32)

    return SlotState(
        cache=KVCache.init(cfg, b, max_len, cache_dtype, bits=kv_bits),
        last=zeros(),
        pos=zeros(),
        gen_len=zeros(),
        max_new=jnp.ones(b, jnp.int32),
        out_tokens=jnp.full((b, capacity), pad_id, jnp.int32),
        out_logprobs=jnp.zeros((b, capacity), jnp.float32),
        out_forced=jnp.zeros((b, capacity), bool),
        finished=jnp.zeros(b, bool),
        reason=zeros(),
        think_done=jnp.zeros(b, bool),
        history=jnp.full((b, max(marker_len, 1)), -1, jnp.int32),
        key_data=jnp.zeros((b, 2), jnp.uint32),
        active=jnp.zeros(b, bool),
        temperature=jnp.ones(b, jnp.float32),
        top_k=zeros(),
        top_p=jnp.ones(b, jnp.float32),
        out_routes=jnp.zeros(
            (b, capacity, cfg.num_layers, cfg.num_experts_per_tok)
            if cfg.num_experts
            else (b, 0, 0, 0),
            jnp.int16,
        ),  # fmt: skip
    )
