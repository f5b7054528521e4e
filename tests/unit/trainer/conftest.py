"""Fixtures of the publisher's tests (`test_publish.py`, `test_publish_far.py`): a tiny llama
checkpoint and a gateway on loopback with its trainer and engine clients."""

import importlib.util
from pathlib import Path

import pytest

from models.checkpoints.hf_io import load_hf_checkpoint

_path = Path(__file__).parents[1] / "rollout_engine" / "worker_harness.py"
_spec = importlib.util.spec_from_file_location("worker_harness", _path)
assert _spec is not None and _spec.loader is not None
_h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_h)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    """(checkpoint folder, ModelConfig, Decoder) of a tiny llama (seed 3, float32)."""
    path = tiny_checkpoint("llama", seed=3)
    cfg, decoder = load_hf_checkpoint(path, dtype="float32")
    return path, cfg, decoder


@pytest.fixture
def gateway():
    """(trainer client, engine client) of a gateway on a free loopback port, stopped after."""
    server, trainer, engine = _h.start_gateway()
    yield trainer, engine
    trainer.close()
    engine.close()
    server.stop(0)
