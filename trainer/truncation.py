"""The engines' top-k / top-p truncation, as a keep-mask over the vocabulary, for the trainer.

Legend: C rows, V vocabulary.

When the engines sample from a truncated, renormalised distribution, their log-probs (vLLM's
``logprobs_mode="processed_logprobs"``, the JAX engine's `rollout_engine.jax.sampling.sample`)
are taken under it; the trainer's log-probs must be too, or the importance ratio is off by the
removed mass even at unchanged weights. The rule is the engines' one, on logits already divided
by the temperature:

1. top-k (``top_k > 0`` and ``< V``): keep logits ``>=`` the k-th largest of the row, so every
   tie of the k-th value is kept (vLLM's PyTorch sampler, `apply_top_k_top_p_pytorch`: sorted
   logits ``< kth`` are masked; the JAX engine's `truncate_logits`);
2. top-p (``top_p < 1``), on the softmax of what top-k kept: by descending probability, keep
   every token whose preceding mass (exclusive cumulative sum) is ``< top_p``, then every token
   whose probability is ``>=`` the smallest kept one (ties kept, as the JAX engine). vLLM
   masks the ascending sorted tokens whose inclusive cumulative mass is ``<= 1 - top_p``: the
   same set but for float rounding of the cumulative sums and the order among exact ties.

One addition: the row's target token is always kept. At unchanged weights the engine sampled
it from the kept set, so this changes nothing there; after the weights moved (lag >= 1, or
within an update) a sampled token can fall outside the trainer's current kept set, and its
log-prob would be -inf (ratio 0, a NaN gradient) instead of a finite, very negative value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def truncation_active(top_k: int, top_p: float, vocab: int) -> bool:
    """Whether (top_k, top_p) removes anything from a vocabulary of `vocab` entries."""
    return 0 < top_k < vocab or top_p < 1.0


def keep_mask(z: jax.Array, targets: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """[C, V] bool: the tokens of each row the engines' truncation keeps, plus the target.

    Args:
      z: [C, V] float32 logits already divided by the temperature.
      targets: [C] int32 the tokens whose log-probs are wanted (always kept).
      top_k: keep the top_k largest logits and their ties; ``<= 0`` or ``>= V`` is off.
      top_p: nucleus mass in (0, 1]; ``>= 1`` is off.

    Returns:
      [C, V] bool, a constant of the computation (no gradient flows through the selection).

    Raises:
      ValueError: for z not [C, V] or top_p <= 0.
    """
    if z.ndim != 2:
        raise ValueError(f"z must be [C, V]; got shape {z.shape}")
    if not top_p > 0:
        raise ValueError(f"top_p must be > 0; got {top_p}")
    z = jax.lax.stop_gradient(z.astype(jnp.float32))
    vocab = z.shape[-1]
    keep = jnp.ones(z.shape, bool)
    if 0 < top_k < vocab:
        kth = jax.lax.top_k(z, top_k)[0][:, -1:]  # [C, 1]
        keep = z >= kth
    if top_p < 1.0:
        probs = jax.nn.softmax(jnp.where(keep, z, -jnp.inf), axis=-1)  # [C, V]
        desc = -jnp.sort(-probs, axis=-1)  # descending
        before = jnp.cumsum(desc, axis=-1) - desc  # exclusive cumulative mass
        n_kept = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1
        floor = jnp.take_along_axis(desc, n_kept - 1, axis=-1)  # smallest kept probability
        keep = keep & (probs >= floor)
    target = jax.nn.one_hot(targets, vocab, dtype=bool)
    return keep | target
