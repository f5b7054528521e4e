"""The loop with background pushes (``sync.background``) against a real gateway on loopback and
the conftest's engine thread: a push held in flight makes the next versions queue and the
middle one skipped, while lags stay within max_lag; a failed push fails the loop (never a hang);
a stop while a push is in flight cancels it and leaves no thread running."""

from __future__ import annotations

import json
import threading

import pytest

from gateway import messages as m
from gateway.client import GatewayClient
from trainer.config import load_config
from trainer.data import ProblemStream
from trainer.data.problem import Problem
from trainer.loop import AsyncTrainer
from trainer.publish.background import PusherFailed
from trainer.rewards import ScoringPool
from trainer.rollout_source import RolloutSource

TARGET = 7  # the conftest engine's rewarded token


class GatedPublisher:
    """Publishes each version on the gateway and waits until every engine loaded it (the
    conftest engine loads at once); the push of `hold` then waits for `gate` (an engine slow to
    load), the push of `fail_at` raises. `cancel_push` ends a held push with an error."""

    def __init__(self, client: GatewayClient, hold: int = 0, fail_at: int = 0) -> None:
        self.client, self.hold, self.fail_at = client, hold, fail_at
        self.gate = threading.Event()
        self.holding = threading.Event()
        self.cancelled = threading.Event()
        self.pushed: list[int] = []

    def push(self, params, version: int) -> None:
        assert isinstance(params, dict) and params  # the host copy, flat by dot path
        if version == self.fail_at:
            raise RuntimeError(f"engine refused version {version}")
        self.client.publish_version(version)
        if not self.client.wait_sync(version, timeout_s=10.0).done:
            raise RuntimeError(f"engines did not load version {version}")
        if version == self.hold:
            self.holding.set()
            while not self.gate.wait(0.05):
                if self.cancelled.is_set():
                    raise RuntimeError(f"push of version {version} cancelled")
        self.pushed.append(version)

    def cancel_push(self) -> None:
        self.cancelled.set()


def _trainer(tmp_path, client, tiny_step, publisher, max_lag: int, **loop):
    cfg = load_config(
        trainer={"prompts_per_step": 2},
        rollout={"group_size": 2, "max_new_tokens": 4, "fetch_timeout_s": 0.2,
                 "max_lag": max_lag, "rollout_timeout_s": 60.0},
        sync={"background": True},
    )  # fmt: skip
    model, step = tiny_step
    scoring = ScoringPool(max_workers=2)
    problems = [Problem(f"p{i}", "", "", "token_fraction", {"token_id": TARGET}) for i in range(40)]
    source = RolloutSource(
        client,
        ProblemStream(problems, shuffle=False),
        lambda p: [1, 2, 4 + 3 * int(p.problem_id[1:])],  # never a multiple of 3 nor 11
        scoring,
        group_size=2,
        sampling=m.SamplingParams(max_new_tokens=4),
        fetch_timeout_s=0.2,
    )
    trainer = AsyncTrainer(cfg, step, step.init_state(model), source, publisher,
                           tmp_path / "run", **loop)  # fmt: skip
    return trainer, scoring


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _push_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "background-push"]


def test_a_held_push_skips_the_version_queued_behind_it(tmp_path, gateway_run, tiny_step):
    _, client, _ = gateway_run
    publisher = GatedPublisher(client, hold=1)
    rows: list[dict] = []

    def on_metrics(row: dict) -> None:
        rows.append(row)
        if row["step"] == 1:  # version 1 was offered: wait until its push is the one held, so
            # version 2 cannot replace it in the queue on a machine slow to wake the thread
            assert publisher.holding.wait(30.0)
        if row["step"] == 3:  # versions 2 and 3 were offered while 1 was held: release it
            publisher.gate.set()

    trainer, scoring = _trainer(tmp_path, client, tiny_step, publisher, 1, on_metrics=on_metrics)
    with scoring:
        summary = trainer.run(5)
    assert (summary.steps, summary.version, summary.stop_reason) == (5, 5, "completed")
    pusher = trainer.pusher
    assert pusher is not None
    # version 2 waited behind the held push of 1 and was replaced by 3 unpushed
    assert pusher.skipped[0] == 2 and 2 not in publisher.pushed
    assert publisher.pushed[:2] == [1, 3] and publisher.pushed[-1] == 5
    assert sorted(publisher.pushed + pusher.skipped) == [1, 2, 3, 4, 5]
    assert pusher.committed == 5 == client.status().current_version  # flushed at the end
    groups = _lines(tmp_path / "run" / "groups.jsonl")
    trained = [g for g in groups if g["outcome"] == "trained"]
    assert len(trained) == 10 == summary.trained_groups
    # every trained token came from a version an engine loaded; none of a skipped one
    served = {v for g in trained for spans in g["version_spans"] for v, _, _ in spans}
    assert served <= {0, *publisher.pushed} and not served & set(pusher.skipped)
    assert all(g["lag"] <= 1 for g in trained)
    assert all(r["lag_max"] <= 1 for r in rows)
    # the loop trained steps 2 and 3 while the push of 1 was in flight
    assert [r["push_committed_version"] for r in rows[:3]] == [0, 0, 0]
    assert _push_threads() == []


def test_a_failed_push_fails_the_loop_waiting_for_rollouts(tmp_path, gateway_run, tiny_step):
    _, client, _ = gateway_run
    publisher = GatedPublisher(client, fail_at=2)
    # max_lag 0: after version 2 no engine may lease (min_version 2, engines at 1): whether the
    # loop is at its next update or already waiting for rollouts, it raises, never waits 60 s
    trainer, scoring = _trainer(tmp_path, client, tiny_step, publisher, 0)
    with scoring, pytest.raises(PusherFailed, match="version 2 failed") as err:
        trainer.run(4)
    assert isinstance(err.value.__cause__, RuntimeError)
    assert err.value.version == 2 and publisher.pushed == [1]
    assert trainer.summary().steps == 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stop_reason"].startswith("PusherFailed: background push of version 2")
    assert _push_threads() == []


def test_a_stop_while_a_push_is_in_flight_cancels_it(tmp_path, gateway_run, tiny_step):
    _, client, _ = gateway_run
    publisher = GatedPublisher(client, hold=2)  # never released: only a cancel ends it

    def stop() -> str | None:
        return "interrupted (test)" if publisher.holding.is_set() else None

    trainer, scoring = _trainer(tmp_path, client, tiny_step, publisher, 1, stop_requested=stop)
    with scoring:
        summary = trainer.run(10)
    assert summary.stop_reason == "interrupted (test)"
    assert publisher.cancelled.is_set() and publisher.pushed == [1]
    assert trainer.pusher is not None and trainer.pusher.committed == 1
    assert not trainer.pusher.alive and _push_threads() == []
    assert summary.steps >= 2


class EveryTwo:
    """An after_update hook due at even steps (as `EvalEvery`): records, when due, the step,
    its version and the version the engine committed then."""

    def __init__(self, client: GatewayClient) -> None:
        self.client = client
        self.seen: list[tuple[int, int, int]] = []

    def due(self, step: int) -> bool:
        return step % 2 == 0

    def __call__(self, step: int, version: int) -> None:
        if self.due(step):
            engine = self.client.status().engines[0]
            self.seen.append((step, version, int(engine.weight_version)))


def test_a_due_after_update_hook_sees_the_engines_at_its_version(tmp_path, gateway_run, tiny_step):
    _, client, _ = gateway_run
    hook = EveryTwo(client)
    trainer, scoring = _trainer(
        tmp_path, client, tiny_step, GatedPublisher(client), 1, after_update=hook
    )
    with scoring:
        trainer.run(4)
    assert hook.seen == [(2, 2, 2), (4, 4, 4)]
