"""An endless, resumable stream of problems: the trainer's data position is one integer.

Epoch e visits every problem once, in the order of a permutation drawn from ``seed + e`` (numpy's
PCG64), or in file order without shuffling. Position p (problems handed out so far) fixes
everything that follows, so a checkpoint stores `position` and a resumed run continues the same
sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trainer.data.problem import Problem


class ProblemStream:
    """Hands out problems in epochs; each comes with a run-unique sample id.

    Args:
      problems: the problem set (at least one).
      seed: shuffling seed.
      shuffle: permute each epoch (True) or keep the given order.
      position: how many problems were already handed out (resume point, >= 0).

    Raises:
      ValueError: for an empty problem set or a negative position.
    """

    def __init__(
        self, problems: Sequence[Problem], *, seed: int = 0, shuffle: bool = True, position: int = 0
    ):
        if not problems:
            raise ValueError("ProblemStream needs at least one problem")
        if position < 0:
            raise ValueError(f"position must be >= 0; got {position}")
        self._problems = list(problems)
        self.seed = seed
        self.shuffle = shuffle
        self._position = position
        self._epoch = -1
        self._order: np.ndarray = np.arange(len(self._problems))

    @property
    def position(self) -> int:
        """Problems handed out so far (store it in checkpoints)."""
        return self._position

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self._problems))
        if self.shuffle and epoch != self._epoch:
            rng = np.random.default_rng(self.seed + epoch)
            self._order = rng.permutation(len(self._problems))
            self._epoch = epoch
        return int(self._order[offset])

    def at(self, position: int) -> Problem:
        """The problem at `position` (the one `next_batch` hands out there), for any position.

        Raises:
          ValueError: for a negative position.
        """
        if position < 0:
            raise ValueError(f"position must be >= 0; got {position}")
        return self._problems[self._index(position)]

    def next_batch(self, n: int) -> list[tuple[str, Problem]]:
        """The next `n` problems as ``(sample_id, problem)``, sample_id = ``"<position>:<id>"``.

        Raises:
          ValueError: for n < 1.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1; got {n}")
        out = []
        for _ in range(n):
            problem = self._problems[self._index(self._position)]
            out.append((f"{self._position}:{problem.problem_id}", problem))
            self._position += 1
        return out
