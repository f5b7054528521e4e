"""In-loop evaluation (eval.every) against a real gateway on loopback and the conftest engine
thread: evaluations at the due steps at exactly that step's weight version, with their metrics;
training groups fetched during an evaluation reach the next update (none lost, none twice); and
the faults (the gateway refusing the eval prompts, a timeout) are logged while training goes on
with the same steps and counts."""

from __future__ import annotations

import json
import time

import pytest

from gateway import messages as m
from trainer.data.problem import Problem
from trainer.launch.eval_every import EvalEvery, append_row
from trainer.launch.evaluate import evaluate

from .test_loop import _lines, _trainer, encode

# prompts [1, 2, 33..36]: 33 and 36 are multiples of 3 (both samples 0.5), 34 and 35 not
# (samples 0.0 and 0.25): accuracy 2.5 / 8, pass@2 (correct: score >= 0.5) 2 / 4
HELD_OUT = [Problem(f"e{i}", "", "", "token_fraction", {"token_id": 7}) for i in range(30, 34)]
SAMPLES = 2


def _evaluator(client, scoring, run_dir, seen, *, max_new_tokens=4, timeout_s=10.0):
    """The job's evaluation (`evaluate`) of HELD_OUT; records (version asked, the versions the
    engines hold) at each call in `seen`."""

    def run(tag, version, hand_over):
        seen.append((version, [e.weight_version for e in client.status().engines]))
        return evaluate(
            client, HELD_OUT, encode, scoring, m.SamplingParams(max_new_tokens=max_new_tokens),
            samples=SAMPLES, version=version, tag=tag, timeout_s=timeout_s, out_dir=run_dir,
            on_training_group=hand_over,
        )  # fmt: skip

    return run


def _check_accounting(trainer, summary, run_dir):
    """submitted = trained + filtered + in flight, every group of groups.jsonl once."""
    filtered = summary.filtered_lag + summary.filtered_zero_variance + summary.filtered_aborted
    assert summary.submitted == summary.trained_groups + filtered + summary.in_flight
    groups = _lines(run_dir / "groups.jsonl")
    ids = [g["sample_id"] for g in groups]
    assert len(ids) == len(set(ids)) == summary.submitted - summary.in_flight
    assert sum(g["outcome"] == "trained" for g in groups) == summary.trained_groups


def test_evaluates_every_n_steps_at_that_version(tmp_path, gateway_run, tiny_step, kit):
    _, client, _ = gateway_run
    trainer, scoring = _trainer(tmp_path, client, tiny_step, kit.VersionPublisher(client))
    run_dir, seen, logged = tmp_path / "run", [], []

    def log(row):
        append_row(run_dir, row)
        logged.append(row)

    every = EvalEvery(2, 6, _evaluator(client, scoring, run_dir, seen), trainer.source, log)
    trainer.after_update = every
    with scoring:
        summary = trainer.run(6)
    # due steps 2 and 4; 6 is the run's last (the end-of-run evaluation's)
    assert [every.due(s) for s in range(1, 7)] == [False, True, False, True, False, False]
    assert seen == [(2, [2]), (4, [4])]  # the engine held exactly the step's version
    rows = _lines(run_dir / "metrics.jsonl")
    evals = [r for r in rows if "eval/tag" in r]
    assert evals == logged
    assert [(r["step"], r["version"], r["eval/tag"]) for r in evals] == [
        (2, 2, "step2"), (4, 4, "step4"),
    ]  # fmt: skip
    for r in evals:
        assert r["eval/accuracy"] == pytest.approx(2.5 / 8) == r["eval/pass@1"]
        assert r["eval/pass@2"] == pytest.approx(0.5)
        assert (r["eval/maj@1"], r["eval/maj@2"]) == (0.0, 0.0)  # no decoder: no answers
        assert (r["eval/mean_length"], r["eval/length_cut_fraction"]) == (4.0, 1.0)
        assert (r["eval/problems"], r["eval/samples"]) == (4, SAMPLES)
    # the eval rows sit after their step's training row: steps 1, 2, e2, 3, 4, e4, 5, 6
    assert [("e" if "eval/tag" in r else "") + str(r["step"]) for r in rows] == [
        "1", "2", "e2", "3", "4", "e4", "5", "6",
    ]  # fmt: skip
    assert len(_lines(run_dir / "eval_step4.jsonl")) == 4
    # the same training: 6 steps of P=2 groups, nothing lost or counted twice
    assert (summary.steps, summary.version, summary.trained_groups) == (6, 6, 12)
    _check_accounting(trainer, summary, run_dir)
    assert every.summary()["failures"] == [] and trainer.source.stale_eval_groups == 0


def test_training_groups_fetched_by_an_evaluation_reach_the_loop(tmp_path, gateway_run, kit):
    from trainer.data import ProblemStream
    from trainer.rewards import ScoringPool
    from trainer.rollout_source import RolloutSource

    _, client, _ = gateway_run
    with ScoringPool(max_workers=2) as scoring:
        source = RolloutSource(
            client, ProblemStream(HELD_OUT, shuffle=False), encode, scoring, group_size=2,
            sampling=m.SamplingParams(max_new_tokens=4), fetch_timeout_s=0.2,
        )  # fmt: skip
        assert source.top_up(3, min_version=0) == 3  # the fetching thread is not running
        deadline = time.monotonic() + 10
        while client.status().queues.ready_groups < 3:  # the engine answered all three
            assert time.monotonic() < deadline
            time.sleep(0.05)
        result = evaluate(
            client, HELD_OUT[:2], encode, scoring, m.SamplingParams(max_new_tokens=4),
            samples=1, version=0, tag="t", timeout_s=10.0, on_training_group=source.accept,
        )  # fmt: skip
        assert (result.problems, result.drained) == (2, 3)
        groups = [source.next_group(5.0) for _ in range(3)]
        assert sorted(g.sample_id for g in groups) == ["0:e30", "1:e31", "2:e32"]
        assert source.consume(groups) == [0, 1, 2]
        assert (source.submitted, source.in_flight, source.waiting_here) == (3, 0, 0)


def test_eval_faults_are_logged_and_training_goes_on(tmp_path, gateway_run, tiny_step, kit):
    _, client, _ = gateway_run
    trainer, scoring = _trainer(tmp_path, client, tiny_step, kit.VersionPublisher(client))
    run_dir, seen, logged = tmp_path / "run", [], []
    # step 2: more new tokens than the gateway accepts (a refusal); step 4: no group back within
    # the eval's silence timeout (its 4 groups come back later, to the training source)
    refused = _evaluator(client, scoring, run_dir, seen, max_new_tokens=(1 << 20) + 1)
    timing_out = _evaluator(client, scoring, run_dir, seen, timeout_s=1e-9)
    every = EvalEvery(
        2, 6, lambda t, v, h: (refused if v == 2 else timing_out)(t, v, h), trainer.source,
        lambda row: (append_row(run_dir, row), logged.append(row)),
    )  # fmt: skip
    trainer.after_update = every
    with scoring:
        summary = trainer.run(6)
    assert summary.stop_reason == "completed"
    assert (summary.steps, summary.version, summary.trained_groups) == (6, 6, 12)
    _check_accounting(trainer, summary, run_dir)
    failures = every.summary()["failures"]
    assert [(f["step"], f["version"]) for f in failures] == [(2, 2), (4, 4)]
    assert failures[0]["error"].startswith("GatewayError: INVALID_ARGUMENT")
    assert "max_new_tokens" in failures[0]["error"]
    assert failures[1]["error"].startswith("TimeoutError: eval 'step4' at version 4")
    assert "eval.timeout_s" in failures[1]["error"]
    rows = [r for r in _lines(run_dir / "metrics.jsonl") if "eval/tag" in r]
    assert rows == logged
    assert [(r["step"], r["eval/error"]) for r in rows] == [
        (f["step"], f["error"]) for f in failures
    ]
    assert not any("eval/accuracy" in r for r in rows)
    # the timed-out evaluation's groups arrived at the training source and were dropped there
    assert trainer.source.stale_eval_groups == len(HELD_OUT)
    assert every.summary()["stale_eval_groups"] == len(HELD_OUT)
    assert json.loads((run_dir / "summary.json").read_text())["stop_reason"] == "completed"
