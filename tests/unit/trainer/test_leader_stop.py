"""`Leader` as a context manager: the followers are told to stop exactly once on every way out
of process 0's ``with`` block, with the reason (the channel is a list beside it; the real
key-value store channel runs in tests/integration/test_main_job_processes.py)."""

from __future__ import annotations

import pytest

from trainer.leader import Leader


class ListChannel:
    def __init__(self) -> None:
        self.posted: list[dict] = []

    def post(self, message: dict) -> None:
        self.posted.append(message)


def _leader() -> tuple[Leader, ListChannel]:
    leader = Leader.__new__(Leader)  # no jax.distributed here: the channel is the list
    leader.channel, leader.stopped = ListChannel(), False
    return leader, leader.channel


def test_a_finished_block_tells_the_followers_once() -> None:
    leader, channel = _leader()
    with leader as same:
        same.post("step")
        same.stop("steps done")  # stop inside the block: the exit adds nothing
    assert channel.posted == [{"op": "step"}, {"op": "stop", "reason": "steps done"}]
    with pytest.raises(RuntimeError, match="op 'push' after the followers were told to stop"):
        leader.post("push")


def test_an_error_reaches_the_followers_as_the_reason_and_is_raised() -> None:
    leader, channel = _leader()
    with pytest.raises(TimeoutError, match="no rollouts"), leader:
        leader.post("push", version=3)
        raise TimeoutError("no rollouts in 600 s" + "!" * 2000)
    assert channel.posted[0] == {"op": "push", "version": 3}
    stop = channel.posted[1]
    assert stop["op"] == "stop" and stop["reason"].startswith("TimeoutError: no rollouts in 600 s")
    assert len(stop["reason"]) == 1000 and len(channel.posted) == 2


def test_a_keyboard_interrupt_is_a_reason_too() -> None:
    leader, channel = _leader()
    with pytest.raises(KeyboardInterrupt), leader:
        raise KeyboardInterrupt
    assert channel.posted == [{"op": "stop", "reason": "KeyboardInterrupt: "}]


def test_a_clean_exit_says_training_finished() -> None:
    leader, channel = _leader()
    with leader:
        pass
    assert channel.posted == [{"op": "stop", "reason": "training and evaluation finished"}]
