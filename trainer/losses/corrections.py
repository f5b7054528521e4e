"""Off-policy corrections any loss can take (``loss.correction``): what the loss's per-token terms
see as the ratio, a detached weight that multiplies them, and which tokens stay in the loss.

Legend: B rows, T positions; r_s = pi_theta / pi_sampler (the ratio every loss of this project
uses by default), pi_prox = the trainer's policy at the start of the step. Within a step the
parameters do not change (one update per batch, gradient accumulation over micro-batches), so
pi_prox equals pi_theta in value: its log-probs are the ones the step computes, under
stop-gradient (no extra forward), and r_prox = pi_theta / sg(pi_theta) is 1 with the gradient of
log pi_theta. The engine-trainer importance weight is w = pi_prox / pi_sampler = sg(r_s).

- `TruncatedIS` (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
  RL Training", TIS): the loss's ratio is r_prox (the trainer's own old policy) and its terms
  are multiplied by min(w, C), per token, or per sequence with w_seq = prod_t w_t over the
  row's masked tokens (their "sequence-level" variant).
- `MaskedIS` (IcePop, Ling team 2025, "Small Leak Can Sink a Great Ship: Boost RL Training on
  MoE with IcePop!"; "masked importance sampling" in verl's rollout correction): tokens whose
  w leaves [1/beta, beta] drop out of the loss (their terms are 0; the normaliser is unchanged);
  the others keep the loss's ratio r_s.
- `DecoupledPPO` (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning
  System for Language Reasoning", eq. 5, after Hilton et al. 2022, "Batch size-invariance for
  policy optimization"): for rows of lag >= 1 the proximal policy is pi_prox, the clip is taken
  on r_prox, and the behaviour policy (the engine) enters only through the weight w (capped
  at ``cap`` if given, AReaL's ``behav_imp_weight_cap``); rows of lag 0 keep the loss's r_s.

Metrics (sums over masked tokens, added over micro-batches by the train step):
``correction/masked_tokens`` (tokens dropped from the loss), ``correction/capped_tokens`` (tokens
whose weight hit the cap), ``correction/weight_sum`` (sum of the weights the terms got).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

CORRECTION_METRICS: tuple[str, ...] = (
    "correction/masked_tokens",
    "correction/capped_tokens",
    "correction/weight_sum",
)


@dataclasses.dataclass(frozen=True)
class Corrected:
    """What a correction hands the loss.

    Attributes:
      ratio: [B, T] float32 the ratio the loss's `token_terms` see (differentiable).
      weight: [B, T] float32 detached factor of each token's term.
      keep: [B, T] float32 1 for tokens that stay in the loss, 0 for dropped ones.
      metrics: the `CORRECTION_METRICS`, [] float32 sums over masked tokens.
    """

    ratio: jax.Array
    weight: jax.Array
    keep: jax.Array
    metrics: dict[str, jax.Array]


def _metrics(mask: jax.Array, keep: jax.Array, weight: jax.Array, capped: jax.Array):
    on = mask > 0
    return {
        "correction/masked_tokens": jnp.sum(on & (keep == 0)).astype(jnp.float32),
        "correction/capped_tokens": jnp.sum(on & capped).astype(jnp.float32),
        "correction/weight_sum": jnp.sum(jnp.where(on, weight * keep, 0.0)),
    }


class Correction(abc.ABC):
    """One off-policy correction (see the module docstring); `name` is its config value."""

    name: ClassVar[str]

    @abc.abstractmethod
    def __call__(
        self, logprobs: jax.Array, sampler: jax.Array, mask: jax.Array, lag: jax.Array
    ) -> Corrected:
        """The correction of a [B, T] batch.

        Args:
          logprobs: [B, T] float32 log pi_theta (differentiable).
          sampler: [B, T] float32 the engine's log-probs.
          mask: [B, T] float32 loss mask (padding may hold anything in the other arrays).
          lag: [B] int each row's lag in weight versions.
        """


def _log_weight(logprobs: jax.Array, sampler: jax.Array, mask: jax.Array) -> jax.Array:
    """[B, T] log w = log sg(pi_theta) - log pi_sampler, 0 outside the mask."""
    return jnp.where(mask > 0, jax.lax.stop_gradient(logprobs) - sampler, 0.0)


def _prox_ratio(logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """[B, T] r_prox = pi_theta / sg(pi_theta): 1 in value, d log pi_theta in gradient."""
    safe = jnp.where(mask > 0, logprobs, 0.0)
    return jnp.exp(safe - jax.lax.stop_gradient(safe))


class TruncatedIS(Correction):
    """TIS: r_prox in the loss, terms times min(w, cap) per token or per sequence.

    Args:
      level: ``"token"`` (w_t) or ``"sequence"`` (the product of the row's w_t).
      cap: C > 0, the truncation (Yao et al. use 2).

    Raises:
      ValueError: for another level or cap <= 0.
    """

    name = "tis"

    def __init__(self, level: str = "token", cap: float = 2.0):
        if level not in ("token", "sequence"):
            raise ValueError(f"level must be 'token' or 'sequence'; got {level!r}")
        if not cap > 0:
            raise ValueError(f"cap must be > 0; got {cap}")
        self.level = level
        self.cap = float(cap)

    def __call__(self, logprobs, sampler, mask, lag):
        log_w = _log_weight(logprobs, sampler, mask)
        if self.level == "sequence":
            log_w = jnp.broadcast_to(jnp.sum(log_w, axis=1, keepdims=True), log_w.shape)
        raw = jnp.exp(jnp.minimum(log_w, 80.0))  # the cap applies next: no overflow to inf
        weight = jnp.minimum(raw, self.cap)
        keep = jnp.ones_like(weight)
        ratio = _prox_ratio(logprobs, mask)
        return Corrected(ratio, weight, keep, _metrics(mask, keep, weight, raw > self.cap))


class MaskedIS(Correction):
    """IcePop / masked importance sampling: tokens with w outside [1/beta, beta] drop out.

    Args:
      beta: > 1, the band's upper end (its lower end is 1 / beta).

    Raises:
      ValueError: for beta <= 1.
    """

    name = "icepop"

    def __init__(self, beta: float = 2.0):
        if not beta > 1:
            raise ValueError(f"beta must be > 1; got {beta}")
        self.beta = float(beta)

    def __call__(self, logprobs, sampler, mask, lag):
        log_w = _log_weight(logprobs, sampler, mask)
        bound = jnp.log(jnp.float32(self.beta))
        keep = (jnp.abs(log_w) <= bound).astype(jnp.float32)
        ratio = jnp.exp(jnp.where(mask > 0, logprobs - sampler, 0.0))
        weight = jnp.ones_like(ratio)
        return Corrected(
            ratio, weight, keep, _metrics(mask, keep, weight, jnp.zeros(keep.shape, bool))
        )


class DecoupledPPO(Correction):
    """AReaL's decoupled PPO for stale rows: clip on r_prox, behaviour weight w, lag >= 1 only.

    Args:
      cap: if set, the behaviour weight is min(w, cap); None: uncapped (AReaL's default).

    Raises:
      ValueError: for cap <= 0.
    """

    name = "decoupled_ppo"

    def __init__(self, cap: float | None = None):
        if cap is not None and not cap > 0:
            raise ValueError(f"cap must be > 0 or None; got {cap}")
        self.cap = None if cap is None else float(cap)

    def __call__(self, logprobs, sampler, mask, lag):
        stale = jnp.broadcast_to((lag >= 1)[:, None], mask.shape)
        log_w = _log_weight(logprobs, sampler, mask)
        raw = jnp.exp(jnp.minimum(log_w, 80.0))
        capped = jnp.zeros(raw.shape, bool) if self.cap is None else raw > self.cap
        w = raw if self.cap is None else jnp.minimum(raw, self.cap)
        own = jnp.exp(jnp.where(mask > 0, logprobs - sampler, 0.0))
        ratio = jnp.where(stale, _prox_ratio(logprobs, mask), own)
        weight = jnp.where(stale, w, 1.0)
        keep = jnp.ones_like(weight)
        return Corrected(ratio, weight, keep, _metrics(mask, keep, weight, capped & stale))


CORRECTIONS: tuple[str, ...] = ("none", "tis_token", "tis_sequence", "icepop", "decoupled_ppo")


def make_correction(
    name: str, *, tis_cap: float = 2.0, icepop_beta: float = 2.0, decoupled_cap: float | None = None
) -> Correction | None:
    """The correction called `name` (one of `CORRECTIONS`; ``"none"`` gives None).

    Raises:
      ValueError: for an unknown name or a bad setting.
    """
    if name == "none":
        return None
    if name in ("tis_token", "tis_sequence"):
        return TruncatedIS(level=name.removeprefix("tis_"), cap=tis_cap)
    if name == "icepop":
        return MaskedIS(beta=icepop_beta)
    if name == "decoupled_ppo":
        return DecoupledPPO(cap=decoupled_cap)
    raise ValueError(f"correction must be one of {CORRECTIONS}; got {name!r}")
