"""The push's waits on the engines fail on silence, not slowness: engines that load one after
another, over more than `loaded_timeout_s` in all but never leaving it silent for longer,
complete the push; an engine that stays silent for longer fails it, named in the error with
how many engines loaded and the publisher setting."""

import importlib.util
import threading
from pathlib import Path

import pytest

from models.checkpoints.hf_io import load_hf_checkpoint
from trainer.publish import PushError, WeightPublisher
from transport.config import FileTransportConfig

_path = Path(__file__).parents[1] / "rollout_engine" / "worker_harness.py"
_spec = importlib.util.spec_from_file_location("worker_harness", _path)
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)

TIMEOUT_S, GAP_S = 3.0, 1.5  # each engine loads GAP_S after the one before


def _push(trainer, cfg, decoder, tmp_path, version):
    transport = FileTransportConfig(root=str(tmp_path / "weights"), timeout_s=60)
    publisher = WeightPublisher(trainer, transport, "llama", cfg, "float32",
                                loaded_timeout_s=TIMEOUT_S)  # fmt: skip
    out: dict = {}

    def run() -> None:
        try:
            out["stats"] = publisher.push(decoder, version)
        except PushError as e:
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


@pytest.mark.parametrize("loading", [3, 1])
def test_loaded_wait_counts_silence_not_the_whole_push(tiny_checkpoint, tmp_path, loading):
    cfg, decoder = load_hf_checkpoint(tiny_checkpoint("llama", seed=3), dtype="float32")
    server, trainer, engine = h.start_gateway()
    backends = [h.FakeBackend() for _ in range(3)]
    runs = []
    try:
        for b in backends:
            b.gate.clear()  # each update waits for its gate before it reads the version
            runs.append(h.WorkerThread(engine, b, lease_wait_s=0.2))
        ids = [r.wait_registered() for r in runs]
        thread, out = _push(trainer, cfg, decoder, tmp_path, 1)
        for b in backends:
            assert b.update_started.wait(60)
        for b in backends[:loading]:
            threading.Event().wait(GAP_S)
            b.gate.set()
        thread.join(120)
        if loading == 3:  # 3 x GAP_S in all, more than TIMEOUT_S; silent GAP_S at most
            assert out["stats"].engines == tuple(sorted(ids))
            assert all(b.weight_version == 1 for b in backends)
        else:
            text = str(out["error"])
            late, loaded = sorted(ids[1:]), [ids[0]]  # ids[i] is backends[i]'s engine
            assert f"engines {late} not loaded: 1/3 reached it ({loaded})" in text
            assert "none more for 3 s (publisher loaded_timeout_s" in text
    finally:
        for b in backends:
            b.gate.set()
        trainer.shutdown()
        for r in runs:
            r.join(60)
        trainer.close()
        engine.close()
        server.stop(0)
