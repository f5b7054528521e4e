"""The optimizer: AdamW with linear warmup and cosine decay, global-norm clipping, accumulation.

Built from optax: ``clip_by_global_norm`` (Pascanu et al. 2013) then ``adamw`` (decoupled weight
decay, Loshchilov & Hutter 2019) with ``warmup_cosine_decay_schedule``; weight decay applies only
to parameters with two or more dimensions (matrices, embeddings), not to norms or biases. With
``grad_accum_steps = k > 1`` the whole chain is wrapped in ``optax.MultiSteps``: it averages k
micro-batch gradients and applies one update every k calls (zero updates in between), and the
schedule counts updates, not micro-steps.
"""

from __future__ import annotations

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer settings.

    Attributes:
      learning_rate: peak learning rate (after warmup), >= 0. 0 keeps the weights fixed: a run
        that measures the engine-trainer mismatch (importance ratio at unchanged weights).
      warmup_steps: updates of linear warmup from 0 to the peak.
      total_steps: updates over which warmup + cosine decay run (>= warmup_steps).
      min_lr_ratio: final learning rate as a fraction of the peak (cosine end value).
      weight_decay: decoupled weight decay coefficient (matrices only).
      b1, b2, eps: Adam moments and epsilon.
      max_grad_norm: clip the global gradient norm to this (None or <= 0 disables clipping).
      grad_accum_steps: micro-batches per update (>= 1).
    """

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    grad_accum_steps: int = 1

    def __post_init__(self) -> None:
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0; got {self.learning_rate}")
        if not 0 <= self.warmup_steps <= self.total_steps or self.total_steps < 1:
            raise ValueError(
                "need 0 <= warmup_steps <= total_steps and total_steps >= 1; got "
                f"{self.warmup_steps}, {self.total_steps}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1]; got {self.min_lr_ratio}")
        if self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1; got {self.grad_accum_steps}")


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Update count -> learning rate: linear 0 -> peak over warmup, cosine to peak * min_lr_ratio
    at `total_steps`, constant after."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps,
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


def decay_mask(params):
    """Pytree of bools like `params`: True for leaves with ndim >= 2 (weight-decayed)."""
    return jax.tree.map(lambda p: getattr(p, "ndim", 0) >= 2, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """The optax transformation described in the module docstring."""
    parts = []
    if cfg.max_grad_norm is not None and cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(
        optax.adamw(
            learning_rate_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    )
    tx = optax.chain(*parts)
    if cfg.grad_accum_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=cfg.grad_accum_steps)
    return tx
