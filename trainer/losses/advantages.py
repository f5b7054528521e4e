"""Group-relative advantages from the rewards of each prompt's G samples (host side, numpy).

GRPO (Shao et al. 2024, DeepSeekMath, sec. 4.1.2): A_i = (r_i - mean(r)) / (std(r) + eps).
Dr. GRPO (Liu et al. 2025, sec. 3.1): A_i = r_i - mean(r).
The std is the population std (ddof=0) of the group's G rewards.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class GroupAdvantages:
    """Advantages and the group statistics they came from, all [P, G] float32.

    `mean` and `std` repeat each group's value over its G columns.
    """

    advantages: np.ndarray
    mean: np.ndarray
    std: np.ndarray


def group_advantages(
    rewards: np.ndarray, *, normalize_std: bool = True, eps: float = 1e-6
) -> GroupAdvantages:
    """Advantages of `rewards` [P, G] (P prompts, G samples each) against their group.

    Args:
      rewards: [P, G] real rewards.
      normalize_std: divide by (std + eps) as GRPO does; False gives Dr. GRPO's r - mean.
      eps: added to the std; a zero-variance group then gets advantages of exactly 0.

    Raises:
      ValueError: if rewards is not 2-D with G >= 1, or holds a NaN or infinity.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] < 1 or r.shape[0] < 1:
        raise ValueError(f"rewards must be [P, G] with P, G >= 1; got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite; got {r.tolist()}")
    mean = r.mean(axis=1, keepdims=True)
    std = r.std(axis=1, keepdims=True)
    adv = r - mean
    if normalize_std:
        adv = adv / (std + eps)
    shape = r.shape
    return GroupAdvantages(
        advantages=adv.astype(np.float32),
        mean=np.broadcast_to(mean, shape).astype(np.float32),
        std=np.broadcast_to(std, shape).astype(np.float32),
    )
