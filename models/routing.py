"""What the routers of a mixture-of-experts Decoder chose, and the load-balancing loss.

`forward_with_routing` runs the model once with every MoE layer recording its router logits
and chosen experts (`models.moe.MoE.record`), and returns them stacked by layer beside the
logits: the expert ids [B, T, L, k] are what routing replay needs (the engine's choices fed
to the trainer's forward), the router logits feed `load_balancing_loss` (the train step's
``loss.moe_aux_coef``).
`forward_with_replay` runs the model with given expert ids (routing replay: the trainer
routes each token as the engine did, so a near-tie in the router cannot send the trainer's
token to other experts than the engine's). `hidden_with_routing` does both at once on the
hidden states (the train step's forward: replay where the engine sent routes, and the
router's own choices recorded for the routing agreement).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import Decoder
from models.kv_cache import KVCache
from models.moe import MoE, Replay, Routing


@dataclasses.dataclass(frozen=True)
class RouterRecord:
    """The routers' outputs of one forward pass.

    Attributes:
        router_logits: [B, T, L, E] float32, every layer's router logits.
        expert_ids: [B, T, L, k] int32, each token's top-k experts per layer, by descending
            router probability.
    """

    router_logits: jax.Array
    expert_ids: jax.Array


def _moe_layers(model: Decoder, what: str) -> list[MoE]:
    moes = [block.mlp for block in model.layers if isinstance(block.mlp, MoE)]
    if not moes:
        raise ValueError(f"{model.cfg.family} has no mixture-of-experts layer to {what}")
    return moes


def _check_ids(model: Decoder, tokens: jax.Array, expert_ids: jax.Array) -> None:
    cfg = model.cfg
    want = (*tokens.shape, cfg.num_layers, cfg.num_experts_per_tok)
    if tuple(expert_ids.shape) != want:
        raise ValueError(
            f"expert_ids must have shape [B, T, L, k] = {want}, got {expert_ids.shape}"
        )
    if not isinstance(expert_ids, jax.core.Tracer) and expert_ids.size:
        low, high = int(jnp.min(expert_ids)), int(jnp.max(expert_ids))
        if low < -1 or high >= cfg.num_experts:
            raise ValueError(
                f"expert_ids must lie in [0, {cfg.num_experts}) or be -1 (no route), got "
                f"[{low}, {high}]"
            )


class RoutingIO:
    """The routes into and the routers' record out of every layer (`models.scan.LayerIO`):
    layer i's MoE takes `expert_ids[:, :, i]` as its replay ids and gives back its router
    logits [B, T, E] float32 and expert ids [B, T, k] int32; a dense layer takes and gives
    None. Scanned, the inputs are the ids as [L, B, T, k] and the outputs come stacked [L, ...].
    """

    def __init__(self, model: Decoder, expert_ids: jax.Array | None) -> None:
        self._moe = [isinstance(block.mlp, MoE) for block in model.layers]
        ids = None if expert_ids is None else expert_ids.astype(jnp.int32)
        n = 0
        self.inputs: list[jax.Array | None] = []
        for is_moe in self._moe:
            self.inputs.append(None if ids is None or not is_moe else ids[:, :, n])
            n += is_moe
        self.stacked_inputs = None if ids is None else jnp.moveaxis(ids, 2, 0)  # [L, B, T, k]

    def enter(self, block: nnx.Module, xi: jax.Array | None) -> None:
        """Set the block's MoE recording and, given ids [B, T, k], replaying them."""
        moe = getattr(block, "mlp", None)
        if isinstance(moe, MoE):
            moe.record = True
            if xi is not None:
                moe.replay_ids = Replay(xi)

    def leave(self, block: nnx.Module) -> tuple[jax.Array, jax.Array] | None:
        """(router logits [B, T, E] float32, expert ids [B, T, k] int32), taken off the
        block's MoE, or None for a dense block."""
        moe = getattr(block, "mlp", None)
        if not isinstance(moe, MoE):
            return None
        moe.record = False
        nnx.pop(moe, Replay)
        recorded = {str(p[-1]): v.get_value() for p, v in nnx.to_flat_state(nnx.pop(moe, Routing))}
        return recorded["router_logits"], recorded["expert_ids"]


def hidden_with_routing(
    model: Decoder,
    tokens: jax.Array,
    positions: jax.Array,
    expert_ids: jax.Array | None = None,
    *,
    cache: KVCache | None = None,
    kv_len: int | None = None,
    attention_block: int = 0,
    scan_layers: bool = False,
    remat: str = "none",
) -> tuple[jax.Array, KVCache | None, RouterRecord]:
    """`model.hidden(tokens, positions, cache, kv_len, attention_block, scan_layers=...,
    remat=...)` with every MoE layer recording its router and, given `expert_ids`, routing
    each token with a route as it says (routing replay; -1: no route, the router's own top-k).
    Without a cache the routes go into each layer and the record comes out of it (`RoutingIO`),
    so the layers may be scanned (`scan_layers`, the ids a scanned input [L, B, T, k]) and
    rematerialised (`remat`); with a cache (the JAX engine) they run in place.

    Args:
        model: a Decoder of a mixture-of-experts config.
        tokens, positions: int32 [B, T].
        expert_ids: int32 [B, T, L, k] or None (every token routed by its own router).
        scan_layers, remat: as `Decoder.hidden` (without a cache only).

    Returns:
        (hidden [B, T, D] in the compute dtype, the updated cache, RouterRecord: the router
        logits are the router's own, the expert ids those the tokens went to).

    Raises:
        ValueError: a dense model, ids not of shape [B, T, L, k], or (for concrete ids) an id
            outside [-1, E).
    """
    moes = _moe_layers(model, "record")
    if expert_ids is not None:
        _check_ids(model, tokens, expert_ids)
    if cache is None:
        return _hidden_with_layer_io(
            model, tokens, positions, expert_ids, attention_block, scan_layers, remat
        )
    if expert_ids is not None:
        for i, moe in enumerate(moes):
            moe.replay_ids = Replay(expert_ids[:, :, i].astype(jnp.int32))
    for moe in moes:
        moe.record = True
    try:
        hidden, cache = model.hidden(tokens, positions, cache, kv_len, attention_block)
    finally:
        for moe in moes:
            moe.record = False
        if expert_ids is not None:
            nnx.pop(model, Replay)
    recorded: dict[str, dict[int, jax.Array]] = {"router_logits": {}, "expert_ids": {}}
    for path, var in nnx.to_flat_state(nnx.pop(model, Routing)):  # ("layers", i, "mlp", name)
        recorded[str(path[-1])][int(str(path[1]))] = var.get_value()
    record = RouterRecord(
        router_logits=jnp.stack([v for _, v in sorted(recorded["router_logits"].items())], 2),
        expert_ids=jnp.stack([v for _, v in sorted(recorded["expert_ids"].items())], 2),
    )
    return hidden, cache, record


def _hidden_with_layer_io(
    model: Decoder,
    tokens: jax.Array,
    positions: jax.Array,
    expert_ids: jax.Array | None,
    attention_block: int,
    scan_layers: bool,
    remat: str,
) -> tuple[jax.Array, None, RouterRecord]:
    """`hidden_with_routing` without a cache: the routes and records through `RoutingIO`."""
    io = RoutingIO(model, expert_ids)
    try:
        hidden, ys = model.hidden_with_layer_io(
            tokens, positions, io, attention_block, scan_layers=scan_layers, remat=remat
        )
    finally:  # a layer that failed in place keeps nothing
        for block in model.layers:
            if isinstance(block.mlp, MoE):
                block.mlp.record = False
                nnx.pop(block.mlp, Replay)
                nnx.pop(block.mlp, Routing)
    if scan_layers:  # ys: ([L, B, T, E], [L, B, T, k])
        logits, ids = jnp.moveaxis(ys[0], 0, 2), jnp.moveaxis(ys[1], 0, 2)
    else:
        mine = [y for y in ys if y is not None]
        logits = jnp.stack([y[0] for y in mine], 2)
        ids = jnp.stack([y[1] for y in mine], 2)
    return hidden, None, RouterRecord(router_logits=logits, expert_ids=ids)


def forward_with_routing(
    model: Decoder,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | None = None,
    kv_len: int | None = None,
) -> tuple[jax.Array, KVCache | None, RouterRecord]:
    """`model(tokens, positions, cache, kv_len)` plus what its routers chose.

    Args:
        model: a Decoder of a mixture-of-experts config (`num_experts` > 0).
        tokens, positions: int32 [B, T]. cache, kv_len: as `Decoder.__call__` (the JAX
            engine's decode records its routes this way).

    Returns:
        (logits [B, T, V] float32, the updated cache, RouterRecord).

    Raises:
        ValueError: a dense model (no MoE layer), named.
    """
    hidden, cache, record = hidden_with_routing(
        model, tokens, positions, cache=cache, kv_len=kv_len
    )
    return model.logits(hidden), cache, record


def forward_with_replay(
    model: Decoder,
    tokens: jax.Array,
    positions: jax.Array,
    expert_ids: jax.Array,
    cache: KVCache | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """`model(tokens, positions, cache)` with every MoE layer routing to `expert_ids`.

    Args:
        model: a Decoder of a mixture-of-experts config.
        tokens, positions: int32 [B, T].
        expert_ids: int32 [B, T, L, k] (`RouterRecord.expert_ids` of the engine's pass); the
            weights are the router's own probabilities at those ids (`models.moe.replay_route`),
            so the router still gets a gradient. A token whose ids hold a -1 has no route and
            is routed by the router's own top-k.

    Returns:
        (logits [B, T, V] float32, the updated cache).

    Raises:
        ValueError: a dense model, ids not of shape [B, T, L, k], or (for concrete ids) an id
            outside [-1, E).
    """
    moes = _moe_layers(model, "replay")
    _check_ids(model, tokens, expert_ids)
    for i, moe in enumerate(moes):
        moe.replay_ids = Replay(expert_ids[:, :, i].astype(jnp.int32))
    try:
        return model(tokens, positions, cache)
    finally:
        nnx.pop(model, Replay)


def load_balancing_loss(
    router_logits: jax.Array, top_k: int, mask: jax.Array | None = None
) -> jax.Array:
    """The auxiliary load-balancing loss of Switch Transformer (Fedus et al. 2021, eqs. 4-6)
    with top-k counts, as HF's `load_balancing_loss_func` (transformers 5.x,
    models/qwen3_moe/modeling_qwen3_moe.py) computes it over all layers together:
    E · Σ_e f_e · P_e, where f_e is the number of top-k assignments to expert e per token and
    P_e the mean router probability of e, both over every (token, layer) row. 1·k for a
    perfectly balanced router; its gradient pushes towards balance.

    Args:
        router_logits: [B, T, L, E] (`RouterRecord.router_logits`).
        top_k: the experts each token goes to.
        mask: [B, T] bool or 0/1, the tokens to count (padding excluded), or None for all.

    Returns:
        A float32 scalar (multiply by the config's `router_aux_loss_coef` to add it to a loss).
    """
    E = router_logits.shape[-1]
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [B, T, L, E]
    _, ids = jax.lax.top_k(probs, top_k)  # [B, T, L, k]
    counts = jnp.sum(jax.nn.one_hot(ids, E, dtype=jnp.float32), axis=-2)  # [B, T, L, E]
    weight = jnp.ones(router_logits.shape[:2], jnp.float32) if mask is None else mask
    w = jnp.broadcast_to(weight.astype(jnp.float32)[:, :, None, None], probs.shape)
    rows = jnp.sum(w[..., 0])
    tokens_per_expert = jnp.sum(counts * w, axis=(0, 1, 2)) / rows  # [E]
    prob_per_expert = jnp.sum(probs * w, axis=(0, 1, 2)) / rows  # [E]
    return E * jnp.sum(tokens_per_expert * prob_per_expert)
