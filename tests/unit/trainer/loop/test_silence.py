"""The rollout wait measures silence: groups that trickle in slower than the timeout in total,
but never silent for longer than it, all arrive; a source that goes silent fails the wait with
a message naming the timeout field, the groups back per engine and the engines registered.

The fake gateway client (the piece beside `RolloutSource`) hands out one group per
`interval_s`, alternating engines e0 and e1, for the first `serve` prompts, then nothing."""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from gateway import messages as m
from trainer.data import ProblemStream
from trainer.data.problem import Problem
from trainer.rewards import ScoringPool
from trainer.rollout_source import RolloutSource

PROBLEMS = [Problem(f"p{i}", "", "", "token_fraction", {"token_id": 7}) for i in range(16)]


class TricklingClient:
    """submit_prompts / fetch_rollouts / status of a gateway whose engines return one group
    every `interval_s` seconds, the first `serve` prompts only."""

    def __init__(self, interval_s: float, serve: int):
        self.interval_s = interval_s
        self.serve = serve
        self.prompts: list[m.Prompt] = []
        self.returned = 0
        self._next_at = time.monotonic() + interval_s
        self._lock = threading.Lock()

    def submit_prompts(self, prompts):
        with self._lock:
            self.prompts.extend(prompts)

    def fetch_rollouts(self, max_groups, timeout_s, min_groups=1):
        with self._lock:
            ready = self.returned < min(self.serve, len(self.prompts))
            wait = self._next_at - time.monotonic()
        if not ready or wait > 0:
            time.sleep(min(timeout_s, max(wait, 0.01)))
            return []
        with self._lock:
            prompt = self.prompts[self.returned]
            engine = f"e{self.returned % 2}"
            self.returned += 1
            self._next_at = time.monotonic() + self.interval_s
        done = m.Completion(np.array([7, 5], np.int32), np.zeros(2, np.float32), "stop", 0, 0)
        return [m.RolloutGroup(prompt.sample_id, (done, done), engine_id=engine, prompt=prompt)]

    def status(self):
        engines = [
            types.SimpleNamespace(
                engine_id=f"e{i}", weight_version=0, leased_prompts=1, last_seen_s=0.5
            )
            for i in range(2)
        ]
        return types.SimpleNamespace(engines=engines)


def _source(client) -> RolloutSource:
    return RolloutSource(
        client,
        ProblemStream(PROBLEMS, shuffle=False),
        lambda p: [1, 2, 3],
        ScoringPool(max_workers=1),
        group_size=2,
        sampling=m.SamplingParams(max_new_tokens=2),
        fetch_timeout_s=0.05,
    )


def test_groups_trickling_in_slower_than_the_timeout_all_arrive():
    # 8 groups, one every 0.25 s: 2 s in all, past the 1.5 s timeout, never silent for 1.5 s
    source = _source(TricklingClient(interval_s=0.25, serve=8)).start()
    try:
        source.top_up(8, min_version=0)
        t0 = time.monotonic()
        groups = [source.next_group(1.5) for _ in range(8)]
        took = time.monotonic() - t0
    finally:
        source.stop()
        source.scoring.close()
    assert took > 1.5  # the whole wait outlasted the timeout
    assert [g.sample_id for g in groups] == [f"{i}:p{i}" for i in range(8)]
    assert source.arrived_from == {"e0": 4, "e1": 4}
    assert source.consume(groups) == list(range(8))
    assert (source.submitted, source.consumed, source.in_flight) == (8, 8, 0)


def test_silence_fails_the_wait_naming_the_field_the_groups_and_the_engines():
    source = _source(TricklingClient(interval_s=0.05, serve=3)).start()
    try:
        source.top_up(8, min_version=0)
        taken = [source.next_group(5.0) for _ in range(3)]
        source.consume(taken)
        with pytest.raises(TimeoutError) as err:
            source.next_group(0.5, waiting_for="the groups of update 1 (3/8 kept)")
    finally:
        source.stop()
        source.scoring.close()
    assert str(err.value) == (
        "waiting for the groups of update 1 (3/8 kept): no group arrived for 0.5 s "
        "(rollout.rollout_timeout_s); 3 groups arrived in this run (e0: 2, e1: 1), 5 prompts "
        "in flight; engines registered now: e0 (version 0, 1 prompts leased, seen 0.5 s ago), "
        "e1 (version 0, 1 prompts leased, seen 0.5 s ago)"
    )


def test_a_stop_request_ends_the_wait_and_keeps_the_groups_in_flight():
    source = _source(TricklingClient(interval_s=0.05, serve=1)).start()
    asked = []
    try:
        source.top_up(2, min_version=0)
        first = source.next_group(5.0)
        assert source.next_group(60.0, should_stop=lambda: asked.append(1) or True) is None
    finally:
        source.stop()
        source.scoring.close()
    assert asked == [1]
    assert first is not None and source.waiting_here == 1  # taken, not consumed: in flight
    assert source.in_flight == 2
    with pytest.raises(KeyError, match="were not taken"):
        source.consume([first, first])
