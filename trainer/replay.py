"""Routing replay in the train step: the forward over the engine's routes, and how often the
trainer's own routers agree with them.

Legend: B rows, L padded length, D model width, N MoE layers, E experts, k experts per token.

A mixture-of-experts engine returns, for each completion token, the experts its routers chose
in the pass that sampled it (`gateway.routes`); `RLBatch.routes` [B, L, N, k] puts them at the
loss positions (-1 elsewhere). With replay on, the trainer's forward sends each token with a
route to those experts (R3, "routing replay": the router's weights at the engine's experts,
`models.moe.replay_route`) and every other token by its own router, so a near-tie the engine
and the trainer break differently cannot make a token's importance ratio compare two different
networks. With replay off the forward is the trainer's own. Either way, whenever routes are
present, the step reports `routing_agreement`: the share of (loss token, layer) pairs whose
set of k experts from the engine equals the set the trainer's own router picks
(`models.moe.route` on the recorded router logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.decoder import Decoder
from models.moe import route
from models.routing import RouterRecord, hidden_with_routing

#: Token sums the step accumulates over micro-batches: pairs whose expert sets agree, pairs.
ROUTE_SUMS = ("routing/agree", "routing/pairs")


def routing_agreement(
    router_logits: jax.Array, routes: jax.Array, mask: jax.Array, norm_topk_prob: bool
) -> dict[str, jax.Array]:
    """Counts of (token, layer) pairs whose engine expert set equals the trainer's own.

    Args:
        router_logits: [B, L, N, E] the trainer's router logits (its own, replay or not).
        routes: [B, L, N, k] int32 the engine's expert ids, -1 where there is no route.
        mask: [B, L] loss mask (0/1); only counted tokens with a route count.
        norm_topk_prob: the family's renormalisation (does not change the chosen set; passed
            so the choice is exactly `models.moe.route`'s, ties included).

    Returns:
        {"routing/agree": [] float32, "routing/pairs": [] float32} (sums; their ratio is the
        agreement).
    """
    k = routes.shape[-1]
    _, own = route(router_logits, k, norm_topk_prob)  # [B, L, N, k] int32
    same = jnp.all(jnp.sort(own, axis=-1) == jnp.sort(routes, axis=-1), axis=-1)  # [B, L, N]
    has = jnp.all(routes >= 0, axis=-1) & (mask[..., None] > 0)  # [B, L, N]
    return {
        "routing/agree": jnp.sum(same & has).astype(jnp.float32),
        "routing/pairs": jnp.sum(has).astype(jnp.float32),
    }


def hidden_with_routes(
    model: Decoder,
    tokens: jax.Array,
    positions: jax.Array,
    routes: jax.Array | None,
    mask: jax.Array,
    *,
    replay: bool,
    attention_block: int = 0,
    scan_layers: bool = False,
    remat: str = "none",
) -> tuple[jax.Array, dict[str, jax.Array], RouterRecord]:
    """The train step's forward with the routers recorded: for a batch with routes (replayed
    or compared), and for the load-balancing loss (`trainer.moe_aux`).

    Args:
        model: a mixture-of-experts Decoder. tokens, positions: int32 [B, L].
        routes: int32 [B, L, N, k], -1 where none (`RLBatch.routes`), or None (no routes: the
            trainer's own routers, no agreement counted). mask: [B, L] loss mask.
        replay: route tokens with a route as the engine did (else the trainer's own routers).
        attention_block, scan_layers, remat: as `Decoder.hidden` (the routes go into a
            scanned or rematerialised layer as its input and the record comes out as its
            output: `models.routing.RoutingIO`).

    Returns:
        (hidden [B, L, D] in the compute dtype, the `routing_agreement` sums ({} without
        routes), the routers' record: router logits [B, L, N, E] float32, expert ids).

    Raises:
        ValueError: a dense model, or routes not of shape [B, L, N, k]
            (`models.routing.hidden_with_routing`).
    """
    replayed = routes if replay and routes is not None else None
    hidden, _, record = hidden_with_routing(
        model, tokens, positions, replayed,
        attention_block=attention_block, scan_layers=scan_layers, remat=remat,
    )  # fmt: skip
    if routes is None:
        return hidden, {}, record
    if replayed is None and tuple(routes.shape[2:]) != tuple(record.expert_ids.shape[2:]):
        raise ValueError(
            f"routes must have [layers, k] = {tuple(record.expert_ids.shape[2:])}, got "
            f"{tuple(routes.shape[2:])}"
        )
    stats = routing_agreement(
        jax.lax.stop_gradient(record.router_logits), routes, mask, model.cfg.norm_topk_prob
    )
    return hidden, stats, record


def check_routing_replay(cfg: ModelConfig, replay: bool) -> None:
    """Refuse routing replay where it cannot run, before any step.

    Raises:
        ValueError: replay on a dense model (no router to replay).
    """
    if replay and not cfg.num_experts:
        raise ValueError(
            f"loss.routing_replay=engine needs a mixture-of-experts model; {cfg.family} is dense"
        )
