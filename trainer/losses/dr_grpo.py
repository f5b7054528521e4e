"""Dr. GRPO: GRPO without the length and std biases.

Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", sec. 3.1: the
advantage is r - mean(group) (no division by the group std) and the per-sequence 1/|o_i| is
replaced by a constant, here ``B * max_tokens`` (the ``"seq_sum_constant"`` aggregation; TRL's
``loss_type="dr_grpo"`` uses the same normaliser).
"""

from __future__ import annotations

from trainer.losses.grpo import GRPOLoss
from trainer.losses.registry import register_loss


@register_loss
class DrGRPOLoss(GRPOLoss):
    """Dr. GRPO: PPO clip, constant normaliser, advantages without std normalisation.

    Args:
      eps_low, eps_high, kl_coef: as in `GRPOLoss`.
      max_tokens: the constant per-sequence length of the normaliser (default: the batch's T;
        set it to the generation budget so the scale does not depend on padding).
    """

    name = "dr_grpo"
    advantage_std_normalization = False

    def __init__(
        self,
        *,
        eps_low: float = 0.2,
        eps_high: float | None = None,
        kl_coef: float = 0.0,
        max_tokens: int | None = None,
    ):
        super().__init__(
            eps_low=eps_low,
            eps_high=eps_high,
            aggregation="seq_sum_constant",
            kl_coef=kl_coef,
            max_tokens=max_tokens,
        )
