"""The consumed-position ledger: out-of-order consumption, a checkpoint with prompts in flight,
and a resume that redoes exactly those (no position skipped, none consumed twice)."""

from __future__ import annotations

import random

import pytest

from trainer.positions import ConsumedPositions, PositionLedger


def test_out_of_order_consumption_moves_the_frontier():
    ledger = PositionLedger()
    assert ledger.take(5) == [0, 1, 2, 3, 4]
    ledger.consume([3, 1])
    assert ledger.consumed() == ConsumedPositions(0, (1, 3))
    assert ledger.in_flight == (0, 2, 4)
    ledger.consume([0])
    assert ledger.consumed() == ConsumedPositions(2, (3,))
    ledger.consume([2])
    assert ledger.consumed() == ConsumedPositions(4, ())
    assert ledger.take(2) == [5, 6]
    assert ledger.consumed().count == 4


def test_resume_redoes_the_positions_in_flight_first():
    ledger = PositionLedger()
    ledger.take(8)
    ledger.consume([0, 1, 2, 5, 7])
    saved = ledger.consumed()
    assert saved == ConsumedPositions(3, (5, 7))  # 3, 4, 6 were in flight: not saved

    resumed = PositionLedger(saved)
    assert resumed.take(4) == [3, 4, 6, 8]  # the ones in flight at the save, then new ones
    assert resumed.take(1) == [9]


def test_consuming_twice_or_never_handed_out_is_refused():
    ledger = PositionLedger(ConsumedPositions(2, (4,)))
    assert ledger.take(2) == [2, 3]
    with pytest.raises(ValueError, match=r"positions \[4\] are not in flight"):
        ledger.consume([4])  # consumed before the resume
    with pytest.raises(ValueError, match=r"positions \[9\] are not in flight"):
        ledger.consume([2, 9])
    assert ledger.in_flight == (2, 3)  # nothing recorded by a refused call
    with pytest.raises(ValueError, match="not in flight"):
        ledger.consume([3, 3])
    ledger.consume([3])
    with pytest.raises(ValueError, match=r"positions \[3\] are not in flight"):
        ledger.consume([3])


def test_bad_restored_state_is_refused():
    with pytest.raises(ValueError, match="frontier must be >= 0"):
        PositionLedger(ConsumedPositions(-1))
    with pytest.raises(ValueError, match="ascend strictly above the frontier 3"):
        PositionLedger(ConsumedPositions(3, (3, 5)))
    with pytest.raises(ValueError, match="ascend strictly"):
        PositionLedger(ConsumedPositions(0, (5, 4)))


@pytest.mark.parametrize("seed", range(5))
def test_many_random_resumes_consume_every_position_once(seed):
    """Random submissions, out-of-order consumptions and checkpoints; at each resume the
    positions in flight are lost (the run stopped) and the ledger restarts from the save."""
    rng = random.Random(seed)
    consumed_log: list[int] = []
    ledger = PositionLedger()
    for _ in range(6):  # six attempts of one run
        for _ in range(rng.randint(1, 30)):
            ledger.take(rng.randint(0, 5))
            flying = list(ledger.in_flight)
            done = rng.sample(flying, rng.randint(0, len(flying)))
            ledger.consume(done)
            consumed_log.extend(done)
        saved = ledger.consumed()
        ledger = PositionLedger(saved)  # the stop: in-flight ones are redone
    final = ledger.consumed()
    assert len(consumed_log) == len(set(consumed_log)) == final.count
    assert set(range(final.frontier)) | set(final.beyond) == set(consumed_log)
