"""Procedural problems from reasoning-gym (e.g. ``chain_sum``, ``basic_arithmetic``), offline.

Entries are generated deterministically from (name, seed, size, config) by
``reasoning_gym.create_dataset``; each problem keeps its whole entry for the dataset's own
checker (`ReasoningGymVerifier`).
"""

from __future__ import annotations

from typing import Any

from trainer.data.problem import Problem


def reasoning_gym_problems(
    name: str, *, size: int, seed: int, suffix: str = "", **config: Any
) -> list[Problem]:
    """Generate `size` problems of the reasoning-gym dataset `name`.

    Args:
      name: a registered reasoning-gym dataset, e.g. "chain_sum" or "basic_arithmetic".
      size: number of problems (>= 1).
      seed: generator seed (same seed, same problems).
      suffix: text appended to each question.
      **config: the dataset's config fields (e.g. ``min_terms=2, max_terms=2`` for chain_sum).

    Returns:
      Problems with id ``"rg/<name>/<seed>/<index>"``, verifier "reasoning_gym", the entry's
      answer as gold, and ``metadata["entry"]`` the entry.

    Raises:
      ValueError: for size < 1 or an unknown dataset name (from reasoning-gym).
    """
    if size < 1:
        raise ValueError(f"size must be >= 1; got {size}")
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    return [
        Problem(
            problem_id=f"rg/{name}/{seed}/{i}",
            question=entry["question"] + suffix,
            answer=str(entry["answer"]),
            verifier="reasoning_gym",
            metadata={"entry": entry},
        )
        for i, entry in enumerate(dataset)
    ]
