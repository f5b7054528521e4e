"""The load-balancing auxiliary loss of a mixture-of-experts policy in the train step
(`loss.moe_aux_coef`).

The term is Switch Transformer's (Fedus et al. 2021, arXiv:2101.03961, eqs. 4-6) in the form
HF transformers adds with `router_aux_loss_coef` (`models.routing.load_balancing_loss`:
E · Σ_e f_e · P_e over every layer's router), counted over the completion tokens the policy
loss counts (the batch's loss mask), so prompt and padding tokens do not pull the routers.
The train step adds `moe_aux_coef` times it to the policy loss and reports it as
``moe_aux_loss`` (``train/moe_aux_loss`` in metrics.jsonl).
"""

from __future__ import annotations

import jax

from models.config import ModelConfig
from models.routing import load_balancing_loss


def check_moe_aux(cfg: ModelConfig, coef: float) -> None:
    """Holds a load-balancing coefficient against the model (scanned and rematerialised layers
    give their routers' logits back as layer outputs: `models.routing.RoutingIO`).

    Raises:
        ValueError: coef < 0; coef > 0 on a dense model (no router to balance). Each message
            names the setting.
    """
    if coef < 0:
        raise ValueError(f"loss.moe_aux_coef must be >= 0; got {coef}")
    if coef > 0 and not cfg.num_experts:
        raise ValueError(
            f"loss.moe_aux_coef={coef} needs a mixture-of-experts model; {cfg.family} is dense "
            "(num_experts=0): set it to 0"
        )


def moe_aux_loss(cfg: ModelConfig, router_logits: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """The load-balancing loss of one forward's routers over the loss-mask tokens.

    Args:
        cfg: the mixture-of-experts model's config (its top-k).
        router_logits: [M, L, N, E] float32, every MoE layer's router logits
            (`models.routing.RouterRecord.router_logits` of the train step's forward).
        loss_mask: [M, L] bool or 0/1, the tokens whose routing is counted (completion tokens).

    Returns:
        [] float32, `models.routing.load_balancing_loss` (Switch Transformer's E · Σ f_e · P_e).
    """
    return load_balancing_loss(router_logits, cfg.num_experts_per_tok, loss_mask)
