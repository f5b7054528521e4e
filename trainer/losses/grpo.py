"""GRPO: the PPO clipped surrogate with group-relative advantages.

Per token, with r = pi_theta / pi_sampler and advantage A (Shao et al. 2024, DeepSeekMath, eq. 3;
the clipped surrogate of Schulman et al. 2017, PPO, eq. 7):

    term = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)

A token counts as clipped when the clipped branch is the smaller one and differs from the
unclipped one: r > 1 + eps_high with A > 0, or r < 1 - eps_low with A < 0 (there the gradient
is zero).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.losses.base import LossInputs, PolicyLoss
from trainer.losses.registry import register_loss


def ppo_clip_terms(
    ratio: jax.Array, adv: jax.Array, eps_low: float, eps_high: float
) -> tuple[jax.Array, jax.Array]:
    """Per-token clipped-surrogate terms [B, T] and the [B, T] bool clipped indicator."""
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    terms = -jnp.minimum(unclipped, clipped)
    was_clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    return terms, was_clipped


@register_loss
class GRPOLoss(PolicyLoss):
    """GRPO with a symmetric-or-not clip range.

    Args:
      eps_low: lower clip, ratio floor 1 - eps_low (default 0.2).
      eps_high: upper clip, ratio ceiling 1 + eps_high (default: eps_low).
      aggregation: ``"seq_mean_token_mean"`` (GRPO paper, default) or ``"token_mean"``.
      kl_coef: weight of the k3 KL term to the reference model (0 disables it).
      max_tokens: constant length for ``"seq_sum_constant"`` (unused otherwise).

    Raises:
      ValueError: for negative clip values or eps_low >= 1.
    """

    name = "grpo"

    def __init__(
        self,
        *,
        eps_low: float = 0.2,
        eps_high: float | None = None,
        aggregation: str = "seq_mean_token_mean",
        kl_coef: float = 0.0,
        max_tokens: int | None = None,
    ):
        super().__init__(aggregation=aggregation, kl_coef=kl_coef, max_tokens=max_tokens)
        eps_high = eps_low if eps_high is None else eps_high
        if not 0 <= eps_low < 1 or eps_high < 0:
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0; got {eps_low}, {eps_high}")
        self.eps_low = float(eps_low)
        self.eps_high = float(eps_high)

    def token_terms(
        self, inputs: LossInputs, ratio: jax.Array, adv: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """PPO clipped surrogate per token (see the module docstring)."""
        return ppo_clip_terms(ratio, adv, self.eps_low, self.eps_high)
