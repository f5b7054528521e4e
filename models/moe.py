"""The mixture-of-experts MLP: a top-k softmax router over E gated-MLP experts.

Axis legend: B batch, T tokens, D model width, E experts (the stacked `experts` axis of
every expert param), M one expert's MLP width, k the experts each token goes to (top-k).

Routing follows HF's `Qwen3MoeTopKRouter` / `OlmoeTopKRouter` (transformers 5.x,
models/qwen3_moe/modeling_qwen3_moe.py, models/olmoe/modeling_olmoe.py): router logits
x·W_r in the model dtype, softmax over the E experts in float32, the k largest
probabilities, renormalised to sum to 1 when `norm_topk_prob` (Qwen3-MoE checkpoints set it;
OLMoE's default is off), cast back to the model dtype. Each expert is a SwiGLU MLP
(Shazeer 2020), and a token's output is the routing-weighted sum of its k experts' outputs.

Dispatch is exact: every token reaches each of its top-k experts, with no capacity limit and
no dropped tokens (GShard / Switch Transformer drop tokens past an expert's capacity). A
dropped token's output would depend on which other tokens share its batch, so the trainer's
log-probs (one batch layout) would differ from the engine's (another): exact dispatch keeps
them equal. `ModelConfig.moe_dispatch` picks how it is computed (`models.moe_dispatch`):
"dense" (every expert on every token, E/k times the FLOPs; the default, right at tiny E on
CPU) or "grouped" (tokens sorted by expert, one grouped matmul per projection).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import KeyStream, Projection
from models.moe_dispatch import dense_dispatch, grouped_dispatch


class Routing(nnx.Variable):
    """Per-layer router outputs a MoE layer records when `record` is on (`models.routing`)."""


class Replay(nnx.Variable):
    """Per-layer expert ids [B, T, k] int32 a MoE layer routes to instead of its own top-k
    (routing replay, `models.routing.forward_with_replay`); a token whose ids hold a -1 has
    no route and takes the router's own top-k."""


class Experts(nnx.Module):
    """E gated-MLP experts stacked on a leading `experts` axis.

    Params (logical axes E experts, D embed, M mlp): gate.kernel / up.kernel [E, D, M],
    down.kernel [E, M, D].
    """

    def __init__(self, cfg: ModelConfig, keys: KeyStream):
        E, D, M, p = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.param_dtype
        self.gate = Projection(keys, (E, D, M), ("experts", "embed", "mlp"), False, p)
        self.up = Projection(keys, (E, D, M), ("experts", "embed", "mlp"), False, p)
        self.down = Projection(keys, (E, M, D), ("experts", "mlp", "embed"), False, p)


def route(logits: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k softmax routing of HF's Qwen3-MoE / OLMoE routers.

    Args:
        logits: router logits [..., E], any float dtype.
        top_k: experts per token, 1 <= top_k <= E.
        norm_topk_prob: renormalise the k probabilities to sum to 1.

    Returns:
        (weights [..., k] in `logits`' dtype, expert ids [..., k] int32), by descending
        probability (ties: the lower expert id first).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(logits.dtype), ids.astype(jnp.int32)


def replay_route(logits: jax.Array, ids: jax.Array, norm_topk_prob: bool) -> jax.Array:
    """The routing weights [..., k] (in `logits`' dtype) of given expert ids [..., k]: the
    router's softmax probabilities at those ids, renormalised as `route` does. With the ids
    `route` chose, the weights `route` gave."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(logits.dtype)


class MoE(nnx.Module):
    """The sparse MLP block: router, top-k routing, E experts, exact dense dispatch.

    Params: router.kernel [D, E]; experts (see Experts).

    With `record` set (by `models.routing.forward_with_routing`), each call stores its router
    logits [B, T, E] float32 and chosen expert ids [B, T, k] int32 as `Routing` variables.
    With a `replay_ids` `Replay` variable (set by `models.routing.forward_with_replay`), the
    tokens go to those experts instead of the router's top-k, weighted by `replay_route`;
    tokens whose replay ids hold a -1 (no route) keep the router's own top-k. The recorded
    `expert_ids` are the ones used; the recorded router logits are the router's own either way.
    """

    replay_ids: Replay  # present only inside `models.routing.forward_with_replay`

    def __init__(self, cfg: ModelConfig, keys: KeyStream):
        self.cfg = cfg
        self.record = False
        self.router = Projection(
            keys, (cfg.hidden_size, cfg.num_experts), ("embed", "experts"), False, cfg.param_dtype
        )
        self.experts = Experts(cfg, keys)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, T, D] (float32 residual stream or the model dtype) -> [B, T, D] in the
        model dtype."""
        cfg = self.cfg
        dt = cfg.dtype
        x = x.astype(dt)  # the float32 residual stream, rounded once for the experts' matmuls
        with jax.named_scope("router"):
            logits = jnp.einsum("btd,de->bte", x, self.router.kernel[...].astype(dt))
            weights, ids = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
            replay = getattr(self, "replay_ids", None)
            if replay is not None:  # a token with a route (ids >= 0) takes it; -1: its own
                given = replay[...]
                ids = jnp.where(jnp.all(given >= 0, axis=-1, keepdims=True), given, ids)
                weights = replay_route(logits, ids, cfg.norm_topk_prob)
        if self.record:
            self.router_logits = Routing(logits.astype(jnp.float32))
            self.expert_ids = Routing(ids)
        B, T, D = x.shape
        k = cfg.num_experts_per_tok
        dispatch = grouped_dispatch if cfg.moe_dispatch == "grouped" else dense_dispatch
        with jax.named_scope("experts"):
            y = dispatch(
                x.reshape(B * T, D),  # [N, D]
                weights.reshape(B * T, k),
                ids.reshape(B * T, k),
                self.experts.gate.kernel[...].astype(dt),
                self.experts.up.kernel[...].astype(dt),
                self.experts.down.kernel[...].astype(dt),
            )
        return y.reshape(B, T, D)
