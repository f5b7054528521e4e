"""CISPO: clipped importance-sampling weight times the log-probability.

MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
eq. 4-5: per token

    term = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta(token)

with sg the stop-gradient, normalised by the total token count of the batch. Unlike PPO's clip,
every token keeps a gradient (only its weight is capped). The paper sets no lower bound (a large
eps_low), the default here (``eps_low=None``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.losses.base import LossInputs, PolicyLoss
from trainer.losses.registry import register_loss


@register_loss
class CISPOLoss(PolicyLoss):
    """CISPO with an upper (and optional lower) cap on the importance weight.

    Args:
      eps_high: weight ceiling 1 + eps_high (default 1.0, a cap of 2).
      eps_low: weight floor 1 - eps_low, or None for no floor (default).
      aggregation: ``"token_mean"`` (paper, default) or another of `AGGREGATIONS`.
      kl_coef: weight of the k3 KL term (0 disables it).

    Raises:
      ValueError: for a negative eps_high or an eps_low outside [0, 1).
    """

    name = "cispo"

    def __init__(
        self,
        *,
        eps_high: float = 1.0,
        eps_low: float | None = None,
        aggregation: str = "token_mean",
        kl_coef: float = 0.0,
        max_tokens: int | None = None,
    ):
        super().__init__(aggregation=aggregation, kl_coef=kl_coef, max_tokens=max_tokens)
        if eps_high < 0 or (eps_low is not None and not 0 <= eps_low < 1):
            raise ValueError(f"need eps_high >= 0, 0 <= eps_low < 1; got {eps_high}, {eps_low}")
        self.eps_high = float(eps_high)
        self.eps_low = None if eps_low is None else float(eps_low)

    def token_terms(
        self, inputs: LossInputs, ratio: jax.Array, adv: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """Stop-gradient clipped weight times advantage times log-prob, negated."""
        low = 0.0 if self.eps_low is None else 1.0 - self.eps_low
        weight = jax.lax.stop_gradient(jnp.clip(ratio, low, 1.0 + self.eps_high))
        was_clipped = ratio > 1.0 + self.eps_high
        if self.eps_low is not None:
            was_clipped = was_clipped | (ratio < low)
        return -weight * adv * inputs.logprobs.astype(jnp.float32), was_clipped
