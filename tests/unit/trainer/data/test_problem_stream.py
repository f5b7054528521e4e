"""The problem stream: epochs are permutations, and a resumed stream continues the same order."""

import pytest

from trainer.data import Problem
from trainer.data.problem_stream import ProblemStream

PROBLEMS = [Problem(f"p{i}", f"q{i}", str(i), "math") for i in range(5)]


def test_epochs_are_permutations_and_ids_are_unique():
    stream = ProblemStream(PROBLEMS, seed=3)
    batch = stream.next_batch(10)
    ids = [p.problem_id for _, p in batch]
    assert sorted(ids[:5]) == sorted(ids[5:]) == [f"p{i}" for i in range(5)]
    assert len({sid for sid, _ in batch}) == 10 and stream.position == 10
    assert batch[0][0] == f"0:{ids[0]}" and batch[7][0] == f"7:{ids[7]}"


def test_resume_continues_the_same_sequence():
    full = ProblemStream(PROBLEMS, seed=7).next_batch(12)
    first = ProblemStream(PROBLEMS, seed=7)
    head = first.next_batch(4)
    tail = ProblemStream(PROBLEMS, seed=7, position=first.position).next_batch(8)
    assert head + tail == full


def test_no_shuffle_keeps_order_and_errors():
    stream = ProblemStream(PROBLEMS, shuffle=False, position=3)
    assert [p.problem_id for _, p in stream.next_batch(4)] == ["p3", "p4", "p0", "p1"]
    with pytest.raises(ValueError, match="at least one problem"):
        ProblemStream([])
    with pytest.raises(ValueError, match="n must be >= 1"):
        stream.next_batch(0)


def test_at_gives_the_problem_next_batch_hands_out_at_any_position():
    handed = ProblemStream(PROBLEMS, seed=5).next_batch(3 * len(PROBLEMS))  # three epochs
    stream = ProblemStream(PROBLEMS, seed=5)
    for position in [12, 2, len(PROBLEMS), 0, 3 * len(PROBLEMS) - 1, 7]:  # out of order
        assert stream.at(position) is handed[position][1]
    with pytest.raises(ValueError, match="position must be >= 0"):
        stream.at(-1)
