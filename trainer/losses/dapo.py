"""DAPO's loss: decoupled clip ("clip-higher") and token-level normalisation.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 8: the PPO
surrogate with clip(r, 1 - eps_low, 1 + eps_high), eps_low = 0.2 and eps_high = 0.28, summed over
every token of the batch and divided by the total token count. DAPO's dynamic sampling (dropping
groups whose rewards are all equal) is `trainer.filters.FilterResult.add(drop_zero_variance=True)`.
"""

from __future__ import annotations

from trainer.losses.grpo import GRPOLoss
from trainer.losses.registry import register_loss


@register_loss
class DAPOLoss(GRPOLoss):
    """DAPO clip-higher with token-mean aggregation.

    Args:
      eps_low: ratio floor 1 - eps_low (default 0.2).
      eps_high: ratio ceiling 1 + eps_high (default 0.28).
      kl_coef: weight of the k3 KL term (DAPO itself uses none: default 0).
    """

    name = "dapo"

    def __init__(self, *, eps_low: float = 0.2, eps_high: float = 0.28, kl_coef: float = 0.0):
        super().__init__(
            eps_low=eps_low, eps_high=eps_high, aggregation="token_mean", kl_coef=kl_coef
        )
