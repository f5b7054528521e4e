"""Inputs, outputs and the shared base class of the policy-gradient losses.

Legend: B sequences in the (micro-)batch, T token positions (aligned with the target tokens, so
`logprobs[b, t]` is the log-probability of the token at target position t of row b).

Every loss turns per-token terms into one scalar by one of three aggregations (`Aggregation`):
- ``"seq_mean_token_mean"``: mean over each sequence's masked tokens, then mean over sequences
  (the original GRPO objective, Shao et al. 2024, DeepSeekMath, eq. 3);
- ``"token_mean"``: sum over every masked token of the batch divided by their count (DAPO,
  Yu et al. 2025, eq. 8, "token-level policy gradient loss"; also CISPO, MiniMax-M1 eq. 4);
- ``"seq_sum_constant"``: sum over every masked token divided by a constant ``B * max_tokens``
  (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training", sec. 3.1: the per-sequence
  ``1/|o_i|`` is replaced by a constant so long wrong answers are not favoured).

With gradient accumulation, pass ``LossInputs.normalizer`` (the denominator over the whole
batch: its masked tokens, sequences or ``B * max_tokens``) so micro-batch losses sum to the
full-batch loss.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp

from trainer.losses.corrections import Correction

Aggregation = Literal["seq_mean_token_mean", "token_mean", "seq_sum_constant"]
AGGREGATIONS: tuple[str, ...] = ("seq_mean_token_mean", "token_mean", "seq_sum_constant")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossInputs:
    """Per-token arrays a policy-gradient loss reads.

    Attributes:
      logprobs: [B, T] float32, log pi_theta(token) under the current parameters (differentiable).
      sampler_logprobs: [B, T] float32, log-probs of the same tokens under the sampling
        distribution (the engine's processed log-probs, after temperature).
      advantages: [B] or [B, T] float32; a [B] array is broadcast over T.
      mask: [B, T] bool or float, 1 on completion tokens that the loss counts, 0 elsewhere.
      ref_logprobs: optional [B, T] float32, log-probs under a frozen reference model (KL term).
      normalizer: optional scalar overriding the aggregation's denominator (see module doc).
      lag: optional [B] int, each row's lag in weight versions (`RLBatch.lag`); read by the
        corrections that treat stale rows apart (`trainer.losses.corrections`), None: all 0.
    """

    logprobs: jax.Array
    sampler_logprobs: jax.Array
    advantages: jax.Array
    mask: jax.Array
    ref_logprobs: jax.Array | None = None
    normalizer: jax.Array | None = None
    lag: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossOutput:
    """The scalar loss to minimise and its metrics.

    Attributes:
      loss: [] float32, the value to minimise (already negated for gradient descent).
      metrics: scalar float32 arrays: ``clip_fraction`` (fraction of masked tokens whose ratio or
        importance weight was clipped), ``ratio_mean`` (masked mean of pi_theta / pi_sampler),
        ``kl`` (masked mean of the k3 estimate of KL(pi_theta || pi_ref); 0 without a reference),
        ``sampler_kl`` (k3 estimate of KL(pi_sampler || pi_theta) from the sampled tokens,
        mean of r - 1 - log r: the trainer/engine mismatch plus the policy's drift since sampling),
        ``pg_loss`` (the policy-gradient part of ``loss``), ``num_tokens`` (masked token count);
        with a correction, its ``correction/...`` sums (`trainer.losses.corrections`).
    """

    loss: jax.Array
    metrics: dict[str, jax.Array]


def validate_inputs(inputs: LossInputs) -> None:
    """Check the shapes of `inputs` (at trace time).

    Raises:
      ValueError: if logprobs is not [B, T], another per-token array differs from [B, T], or the
        advantages are neither [B] nor [B, T].
    """
    shape = tuple(inputs.logprobs.shape)
    if len(shape) != 2:
        raise ValueError(f"logprobs must be [B, T]; got shape {shape}")
    for name in ("sampler_logprobs", "mask", "ref_logprobs"):
        value = getattr(inputs, name)
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} must have the shape of logprobs {shape}; got {value.shape}")
    adv_shape = tuple(inputs.advantages.shape)
    if adv_shape not in (shape[:1], shape):
        raise ValueError(f"advantages must be [B]={shape[:1]} or [B, T]={shape}; got {adv_shape}")


def token_advantages(inputs: LossInputs) -> jax.Array:
    """Advantages broadcast to [B, T] float32."""
    adv = inputs.advantages.astype(jnp.float32)
    if adv.ndim == 1:
        adv = adv[:, None]
    return jnp.broadcast_to(adv, inputs.logprobs.shape)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of `x` [B, T] over positions where `mask` [B, T] is set; 0 when none is."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(mask > 0, x * mask, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def aggregate(
    token_terms: jax.Array,
    mask: jax.Array,
    mode: str,
    *,
    max_tokens: int | None = None,
    normalizer: jax.Array | None = None,
) -> jax.Array:
    """Reduce per-token terms [B, T] to a scalar with one of `AGGREGATIONS`.

    Args:
      token_terms: [B, T] float32 per-token loss terms.
      mask: [B, T] tokens that count.
      mode: one of `AGGREGATIONS` (see the module docstring for the formulas and sources).
      max_tokens: the constant per-sequence length of ``"seq_sum_constant"``; default T.
      normalizer: if given, replaces the denominator (for gradient accumulation).

    Raises:
      ValueError: for an unknown `mode`.
    """
    mask = mask.astype(jnp.float32)
    terms = jnp.where(mask > 0, token_terms * mask, 0.0)  # NaN or inf in padding must not leak
    if mode == "token_mean":
        numerator = jnp.sum(terms)
        denominator = jnp.maximum(jnp.sum(mask), 1.0)
    elif mode == "seq_mean_token_mean":
        seq_tokens = jnp.sum(mask, axis=1)
        numerator = jnp.sum(jnp.sum(terms, axis=1) / jnp.maximum(seq_tokens, 1.0))
        denominator = jnp.maximum(jnp.sum(seq_tokens > 0), 1).astype(jnp.float32)
    elif mode == "seq_sum_constant":
        numerator = jnp.sum(terms)
        length = token_terms.shape[1] if max_tokens is None else max_tokens
        denominator = jnp.asarray(token_terms.shape[0] * length, jnp.float32)
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}; got {mode!r}")
    if normalizer is not None:
        denominator = jnp.asarray(normalizer, jnp.float32)
    return numerator / denominator


def k3_kl(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): exp(d) - d - 1 with d = ref - logprobs.

    Unbiased and non-negative (J. Schulman, "Approximating KL Divergence", 2020; the estimator of
    DeepSeekMath's GRPO, eq. 4). Shapes [B, T] float32 in, [B, T] out.
    """
    d = ref_logprobs - logprobs
    return jnp.exp(d) - d - 1.0


class PolicyLoss(abc.ABC):
    """A policy-gradient loss: per-token terms, an aggregation and an optional k3 KL term.

    Subclasses set `name` and `advantage_std_normalization` (whether the group advantages divide
    by the group's reward std), and implement `token_terms`. An off-policy correction
    (`with_correction`) changes the ratio `token_terms` sees and weights or drops its terms, for
    every loss alike (`trainer.losses.corrections`).
    """

    name: ClassVar[str]
    advantage_std_normalization: ClassVar[bool] = True

    def __init__(self, *, aggregation: str, kl_coef: float = 0.0, max_tokens: int | None = None):
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}; got {aggregation!r}")
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0; got {kl_coef}")
        if max_tokens is not None and max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive; got {max_tokens}")
        self.aggregation = aggregation
        self.kl_coef = float(kl_coef)
        self.max_tokens = max_tokens
        self.correction: Correction | None = None

    def with_correction(self, correction: Correction | None) -> PolicyLoss:
        """Apply `correction` (`trainer.losses.corrections`; None: none) to this loss; returns
        the loss itself."""
        self.correction = correction
        return self

    @abc.abstractmethod
    def token_terms(
        self, inputs: LossInputs, ratio: jax.Array, adv: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """Per-token loss terms [B, T] (to minimise) and a [B, T] bool "was clipped" array.

        `ratio` [B, T] is exp(logprobs - sampler_logprobs) (differentiable), `adv` the [B, T]
        advantages.
        """

    def __call__(self, inputs: LossInputs) -> LossOutput:
        """Compute the loss and its metrics for `inputs` (shapes in `LossInputs`).

        Raises:
          ValueError: on shape mismatches, or if ``kl_coef > 0`` and no `ref_logprobs` are given.
        """
        validate_inputs(inputs)
        if self.kl_coef > 0 and inputs.ref_logprobs is None:
            raise ValueError(f"{self.name}: kl_coef={self.kl_coef} needs ref_logprobs; got None")
        logprobs = inputs.logprobs.astype(jnp.float32)
        sampler = inputs.sampler_logprobs.astype(jnp.float32)
        mask = inputs.mask.astype(jnp.float32)
        # Padding positions may hold arbitrary log-probs: zero the difference there so exp never
        # overflows into a NaN that the mask multiply would not remove.
        log_ratio = jnp.where(mask > 0, logprobs - sampler, 0.0)
        ratio = jnp.exp(log_ratio)
        loss_ratio, extra = ratio, {}
        weight = keep = jnp.ones_like(ratio)
        if self.correction is not None:
            lag = jnp.zeros(mask.shape[:1], jnp.int32) if inputs.lag is None else inputs.lag
            fix = self.correction(logprobs, sampler, mask, lag)
            loss_ratio, weight, keep, extra = fix.ratio, fix.weight, fix.keep, fix.metrics
        terms, clipped = self.token_terms(inputs, loss_ratio, token_advantages(inputs))
        terms = terms * jax.lax.stop_gradient(weight * keep)
        agg = functools.partial(
            aggregate,
            mode=self.aggregation,
            max_tokens=self.max_tokens,
            normalizer=inputs.normalizer,
        )
        pg_loss = agg(terms, mask)
        if inputs.ref_logprobs is not None:
            # mask before exp: an inf in padding would make a NaN gradient through a later where
            ref = jnp.where(mask > 0, inputs.ref_logprobs.astype(jnp.float32), 0.0)
            kl_tokens = k3_kl(jnp.where(mask > 0, logprobs, 0.0), ref)
            kl_mean = masked_mean(kl_tokens, mask)
        else:
            kl_tokens = jnp.zeros_like(logprobs)
            kl_mean = jnp.zeros((), jnp.float32)
        loss = pg_loss
        if self.kl_coef > 0:
            loss = loss + self.kl_coef * agg(kl_tokens, mask)
        metrics = {
            "pg_loss": pg_loss,
            "clip_fraction": masked_mean(clipped.astype(jnp.float32), mask),
            "ratio_mean": masked_mean(jax.lax.stop_gradient(ratio), mask),
            "kl": jax.lax.stop_gradient(kl_mean),
            "sampler_kl": masked_mean(jax.lax.stop_gradient(ratio - 1.0 - log_ratio), mask),
            "num_tokens": jnp.sum(mask),
            **extra,
        }
        return LossOutput(loss=loss, metrics=metrics)
