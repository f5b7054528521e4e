"""Silence clocks: progress restarts them, the error counts what came and from whom and names
the config key; the drain after a stop fails on silence with that error, against a real
gateway."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from trainer.launch.evaluate import drain_training_groups
from trainer.launch.silence import SilenceClock, engines_line

_path = Path(__file__).parents[2] / "rollout_engine" / "worker_harness.py"
_spec = importlib.util.spec_from_file_location("worker_harness", _path)
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)


def test_progress_restarts_the_clock_and_the_error_says_who_sent_what():
    clock = SilenceClock(60.0, "eval.timeout_s")
    clock.progressed("jax-1", 2)
    clock.progressed("jax-2")
    clock.progressed("jax-2", 0)  # nothing arrived: no progress
    assert clock.sources() == "jax-1: 2, jax-2: 1"
    assert 59.0 < clock.left() <= 60.0
    text = str(clock.expired("eval 'x': 3/4 groups back"))
    assert text.startswith("eval 'x': 3/4 groups back: nothing came back for ")
    assert "(silence limit eval.timeout_s=60)" in text and "came from jax-1: 2, jax-2: 1" in text
    with pytest.raises(ValueError, match="eval.timeout_s: expected > 0 seconds, got 0"):
        SilenceClock(0.0, "eval.timeout_s")


def test_drain_fails_on_silence_naming_the_key_and_the_engines():
    server, trainer, engine = h.start_gateway()
    try:
        assert engines_line(trainer.status()) == "none registered"
        assert drain_training_groups(trainer, 0, 0.5) == 0
        with pytest.raises(TimeoutError) as err:
            drain_training_groups(trainer, 2, 0.5, "launch.some_timeout_s")
        text = str(err.value)
        assert "drain after the stop: 0/2 in-flight training groups back" in text
        assert "launch.some_timeout_s=0.5" in text
        assert text.endswith("came from nobody; engines: none registered")
    finally:
        trainer.close()
        engine.close()
        server.stop(0)
