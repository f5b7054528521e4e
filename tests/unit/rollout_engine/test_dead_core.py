"""Issue 25 item 4(b): a backend whose inference core died (vLLM's EngineDeadError while the
engine process lives) makes the worker stop leasing, release its prompts, deregister and end
with "backend dead" (the engine process then exits 1), instead of releasing every prompt it
leases until the gateway aborts them. The fake backend beside the worker raises the error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rollout_engine.dead_core import BackendDead, is_dead_core

_spec = importlib.util.spec_from_file_location(
    "worker_harness", Path(__file__).with_name("worker_harness.py")
)
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)


class EngineDeadError(Exception):
    """Stands for vLLM's (matched by class name; its message is vLLM's own)."""

    def __init__(self) -> None:
        super().__init__(
            "EngineCore encountered an issue. See stack trace (above) for the root cause."
        )


class DeadCore(h.FakeBackend):
    """The fake backend whose core dies at its first generate: every call raises."""

    async def generate(self, prompt):
        self.calls.append((prompt.sample_id, self._version))
        raise EngineDeadError()


@pytest.fixture
def gateway():
    server, trainer, engine = h.start_gateway(max_prompt_releases=3)
    yield server, trainer, engine
    trainer.close()
    engine.close()
    server.stop(0)


def test_dead_core_stops_leasing_releases_and_deregisters(gateway):
    server, trainer, engine = gateway
    backend = DeadCore()
    run = h.WorkerThread(engine, backend)
    engine_id = run.wait_registered()
    trainer.submit_prompts([h.prompt("p0", [1, 2]), h.prompt("p1", [3])])
    assert run.join() == "backend dead"
    assert run.worker.backend_error == (
        "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the "
        "root cause."
    )
    status = trainer.status()
    assert [e.engine_id for e in status.engines] == []  # deregistered
    assert status.queues.pending_train == 2  # both prompts back, none aborted
    assert trainer.fetch_rollouts(max_groups=2, timeout_s=0.2) == []
    # it leased once: at most the prompts of that lease reached the dead backend, none twice
    ids = [sid for sid, _ in backend.calls]
    assert len(ids) == len(set(ids)) and set(ids) <= {"p0", "p1"}
    by = [e["by"] for e in server.state.events.events("deregistered") if e["engine"] == engine_id]
    assert by == ["engine"]


@pytest.mark.parametrize(
    ("err", "dead"),
    [
        (EngineDeadError(), True),
        (BackendDead("the JAX decode loop is gone"), True),
        (RuntimeError("Engine core is dead"), True),
        (RuntimeError("request r-1 ended without its 2 samples"), False),
        (ValueError("prompt too long"), False),
    ],
)
def test_is_dead_core(err, dead):
    assert is_dead_core(err) is dead


def test_a_dead_core_raised_from_is_seen_through_the_cause():
    try:
        try:
            raise EngineDeadError()
        except EngineDeadError as inner:
            raise RuntimeError("generate failed") from inner
    except RuntimeError as outer:
        assert is_dead_core(outer)
