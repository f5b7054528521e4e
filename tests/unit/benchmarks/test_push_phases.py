"""`benchmarks/push_phases`: the engine's phase lines of a real worker log line format, and a
push's five parts from both sides' phases, none negative, adding up to the push."""

from __future__ import annotations

import json
import logging

import pytest

from tests.unit.benchmarks.loading import load_benchmark
from trainer.publish.publisher import PushStats


@pytest.fixture(scope="module")
def push_phases():
    return load_benchmark("push_phases")


ENGINE = {
    "start_s": 0.01, "wait_s": 0.2, "copy_s": 0.02, "load_s": 0.5, "commit_s": 0.01,
    "finish_s": 0.05, "reset_s": 0.002, "update_s": 0.8, "check": 0.03, "load": 0.85,
}  # fmt: skip


def test_engine_phases_read_the_workers_loaded_lines(push_phases, caplog):
    log = logging.getLogger("rollout_engine.worker")
    with caplog.at_level(logging.INFO, logger="rollout_engine.worker"):
        for v in (1, 2):  # the worker's own format (`EngineWorker._sync`)
            log.info("loaded version %d in %.2f s; phases %s", v, 0.9, json.dumps(ENGINE))
    text = "vllm noise\n" + "\n".join(r.getMessage() for r in caplog.records) + "\n"
    assert push_phases.engine_phases(text) == {1: ENGINE, 2: ENGINE}


def test_breakdown_parts_are_non_negative_and_add_up_to_the_push(push_phases):
    send = {"offer_s": 0.06, "pack_s": 0.15, "wire_s": 0.35, "commit_s": 0.1}
    ready, send_s, loaded = 0.02, sum(send.values()), 0.09
    stats = PushStats(
        3, 269_000_000, 272, 2, ("e0",), ready, send_s, loaded, ready + send_s + loaded,
        send_phases=send,
    )  # fmt: skip
    parts = push_phases.push_breakdown(stats, ENGINE)
    assert tuple(parts) == push_phases.BREAKDOWN_KEYS
    assert parts["pack_s"] == 0.15 and parts["wire_s"] == 0.35
    assert parts["receive_copy_s"] == 0.02
    assert parts["engine_load_s"] == pytest.approx(0.01 + 0.5 + 0.05 + 0.002)
    # ready + loaded beyond finish and reset, the offer beyond the set-up, the vote
    assert parts["commit_vote_s"] == pytest.approx(0.02 + 0.09 - 0.052 + 0.05 + 0.01)
    assert min(parts.values()) >= 0
    # overlap allowed by the pipeline: the copy and load of all buckets but the last
    slack = ENGINE["copy_s"] + ENGINE["load_s"]
    assert sum(parts.values()) <= stats.seconds + slack


def test_a_missing_phase_is_a_key_error(push_phases):
    stats = PushStats(1, 1, 1, 1, (), 0.0, 0.1, 0.0, 0.1)  # a transport that times nothing
    with pytest.raises(KeyError):
        push_phases.push_breakdown(stats, ENGINE)
