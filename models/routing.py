"""What the routers of a mixture-of-experts Decoder chose, and the load-balancing loss.

`forward_with_routing` runs the model once with every MoE layer recording its router logits
and chosen experts (`models.moe.MoE.record`), and returns them stacked by layer beside the
logits: the expert ids [B, T, L, k] are what routing replay needs (the engine's choices fed
to the trainer's forward), the router logits feed `load_balancing_loss`;
`hidden_with_routing` is the same for `Decoder.hidden` (the train step's forward, whose
load-balancing loss is `loss.moe_aux_coef`).
`forward_with_replay` runs the model with given expert ids (routing replay: the trainer
routes each token as the engine did, so a near-tie in the router cannot send the trainer's
token to other experts than the engine's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

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


def forward_with_routing(
    model: Decoder,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | None = None,
) -> tuple[jax.Array, KVCache | None, RouterRecord]:
    """`model(tokens, positions, cache)` plus what its routers chose.

    Args:
        model: a Decoder of a mixture-of-experts config (`num_experts` > 0).
        tokens, positions: int32 [B, T].

    Returns:
        (logits [B, T, V] float32, the updated cache, RouterRecord).

    Raises:
        ValueError: a dense model (no MoE layer), named.
    """
    (logits, cache), record = _recording(model, lambda: model(tokens, positions, cache))
    return logits, cache, record


def hidden_with_routing(
    model: Decoder, tokens: jax.Array, positions: jax.Array, **hidden_kwargs: Any
) -> tuple[jax.Array, RouterRecord]:
    """`model.hidden(tokens, positions, **hidden_kwargs)` (no cache: the train step's forward)
    plus what its routers chose, for the load-balancing loss of the train step.

    Args:
        model: a Decoder of a mixture-of-experts config.
        tokens, positions: int32 [B, T].
        hidden_kwargs: `Decoder.hidden`'s keywords (attention_block, remat); the layers must
            run in place (scan_layers False, remat "none": `models.scan.loop_blocks`), else
            the routers' records are dropped.

    Returns:
        (hidden [B, T, D] in the compute dtype, RouterRecord).

    Raises:
        ValueError: a dense model, or scan_layers / a remat policy (the records would be lost).
    """
    if hidden_kwargs.get("scan_layers") or hidden_kwargs.get("remat", "none") != "none":
        raise ValueError(
            "the routers' records need the layers run in place: scan_layers=False, remat='none'"
        )
    (hidden, _), record = _recording(
        model, lambda: model.hidden(tokens, positions, **hidden_kwargs)
    )
    return hidden, record


def _recording(model: Decoder, run: Callable[[], Any]) -> tuple[Any, RouterRecord]:
    """`run()` with every MoE layer of `model` recording, and the records stacked by layer.

    Raises:
        ValueError: a dense model (no MoE layer), named.
    """
    moes = [block.mlp for block in model.layers if isinstance(block.mlp, MoE)]
    if not moes:
        raise ValueError(f"{model.cfg.family} has no mixture-of-experts layer to record")
    for moe in moes:
        moe.record = True
    try:
        out = run()
    finally:
        for moe in moes:
            moe.record = False
    recorded: dict[str, dict[int, jax.Array]] = {"router_logits": {}, "expert_ids": {}}
    for path, var in nnx.to_flat_state(nnx.pop(model, Routing)):  # ("layers", i, "mlp", name)
        recorded[str(path[-1])][int(str(path[1]))] = var.get_value()
    record = RouterRecord(
        router_logits=jnp.stack([v for _, v in sorted(recorded["router_logits"].items())], 2),
        expert_ids=jnp.stack([v for _, v in sorted(recorded["expert_ids"].items())], 2),
    )
    return out, record


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
            so the router still gets a gradient.

    Returns:
        (logits [B, T, V] float32, the updated cache).

    Raises:
        ValueError: a dense model, ids not of shape [B, T, L, k], or (for concrete ids) an id
            outside [0, E).
    """
    cfg = model.cfg
    moes = [block.mlp for block in model.layers if isinstance(block.mlp, MoE)]
    if not moes:
        raise ValueError(f"{cfg.family} has no mixture-of-experts layer to replay")
    want = (*tokens.shape, cfg.num_layers, cfg.num_experts_per_tok)
    if tuple(expert_ids.shape) != want:
        raise ValueError(
            f"expert_ids must have shape [B, T, L, k] = {want}, got {expert_ids.shape}"
        )
    if not isinstance(expert_ids, jax.core.Tracer):
        low, high = int(jnp.min(expert_ids)), int(jnp.max(expert_ids))
        if low < 0 or high >= cfg.num_experts:
            raise ValueError(f"expert_ids must lie in [0, {cfg.num_experts}), got [{low}, {high}]")
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
