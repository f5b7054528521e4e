"""The run's data position, exact across a resume: which problem positions were consumed.

A position is an index into the problem stream (`trainer.rewards.ProblemStream.at`), which fixes
the problem there, so a set of positions is the whole data state of a run. A position is
*consumed* once the training thread trained its group or filtered it (lag, zero variance,
aborted); it is *in flight* from its submission until then. A checkpoint stores the consumed
ones as a frontier (every position below it is consumed) plus the few consumed positions above
it (groups come back out of order); the in-flight ones are not stored: after a resume they are
handed out again, in order, before any new position. So no problem is skipped and none is
consumed twice, whatever was in flight when the run stopped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class ConsumedPositions:
    """What a checkpoint stores.

    Attributes:
      frontier: every position below it is consumed (>= 0).
      beyond: the consumed positions >= frontier, ascending (never holding frontier itself).
    """

    frontier: int = 0
    beyond: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        """Positions consumed in all."""
        return self.frontier + len(self.beyond)


class PositionLedger:
    """Hands out positions and records their consumption.

    Args:
      restored: the consumed positions of the checkpoint resumed from (default: none).

    Raises:
      ValueError: a negative frontier, or `beyond` not strictly ascending above the frontier.
    """

    def __init__(self, restored: ConsumedPositions | None = None):
        restored = restored or ConsumedPositions()
        beyond = list(restored.beyond)
        if restored.frontier < 0:
            raise ValueError(f"frontier must be >= 0; got {restored.frontier}")
        if beyond and (beyond[0] <= restored.frontier or beyond != sorted(set(beyond))):
            raise ValueError(
                f"beyond must ascend strictly above the frontier {restored.frontier}; "
                f"got {beyond[:8]}..."
            )
        self._frontier = restored.frontier
        self._consumed: set[int] = set(beyond)
        self._skip: set[int] = set(beyond)  # consumed before the resume: never handed out
        self._cursor = restored.frontier
        self._in_flight: set[int] = set()

    @property
    def frontier(self) -> int:
        """Every position below it is consumed."""
        return self._frontier

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Positions handed out and not consumed, ascending."""
        return tuple(sorted(self._in_flight))

    def consumed(self) -> ConsumedPositions:
        """The state to checkpoint (in-flight positions are left out: they are redone)."""
        return ConsumedPositions(self._frontier, tuple(sorted(self._consumed)))

    def take(self, n: int) -> list[int]:
        """The next `n` positions to submit, ascending: the lowest ones neither consumed nor in
        flight (after a resume, the ones in flight at the checkpoint come first).

        Raises:
          ValueError: n < 0.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0; got {n}")
        out: list[int] = []
        while len(out) < n:
            position = self._cursor
            self._cursor += 1
            if position in self._skip:
                self._skip.discard(position)
                continue
            out.append(position)
        self._in_flight.update(out)
        return out

    def consume(self, positions: Iterable[int]) -> None:
        """Record that the groups of `positions` were trained or filtered.

        Raises:
          ValueError: a position that is not in flight (never handed out, or consumed already);
            nothing is recorded then.
        """
        batch = list(positions)
        wrong = [p for p in batch if p not in self._in_flight] or (
            [] if len(set(batch)) == len(batch) else batch
        )
        if wrong:
            raise ValueError(f"positions {sorted(wrong)[:8]} are not in flight (consumed twice?)")
        self._in_flight.difference_update(batch)
        self._consumed.update(batch)
        while self._frontier in self._consumed:
            self._consumed.discard(self._frontier)
            self._frontier += 1
