"""Heartbeats are long polls: a published version reaches the engine at once."""

import threading
import time

from gateway import messages as m
from gateway.heartbeat import HeartbeatThread

SPEC = m.EngineSpec(backend="jax", model_family="llama", dtype="bf16", transports=("gloo",))


def test_long_poll_answers_as_soon_as_a_version_is_published(server):
    reg = server.engine.register_engine(SPEC)
    quick = server.engine.heartbeat(reg.engine_id)
    assert quick.sync is None and quick.current_version == 0
    threading.Timer(0.3, lambda: server.trainer.publish_version(4, {"bucket_mb": "64"})).start()
    t0 = time.monotonic()
    beat = server.engine.heartbeat(reg.engine_id, wait_s=3.0)
    waited = time.monotonic() - t0
    assert 0.25 < waited < 2.0, waited
    assert beat.sync == m.SyncDirective(4, {"bucket_mb": "64"}, 1) and beat.current_version == 4
    t0 = time.monotonic()
    again = server.engine.heartbeat(reg.engine_id, wait_s=0.5, known_target=4)
    assert 0.45 < time.monotonic() - t0 < 2.0  # nothing newer than 4: waits the whole poll
    assert again.sync == m.SyncDirective(4, {"bucket_mb": "64"}, 1)


def test_heartbeat_thread_calls_on_sync_once_per_version_and_stops_when_dropped(server):
    reg = server.engine.register_engine(SPEC)
    seen: list[m.SyncDirective] = []
    beats = HeartbeatThread(server.engine, reg.engine_id, 1.0, on_sync=seen.append).start()
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        server.trainer.publish_version(1)
        while not seen and time.monotonic() - t0 < 2:
            time.sleep(0.01)
        assert time.monotonic() - t0 < 0.5, "the directive took a whole interval"
        server.engine.ack_version(reg.engine_id, 1)
        server.trainer.publish_version(2)
        time.sleep(0.3)
        assert [d.target_version for d in seen] == [1, 2]
        server.engine.deregister(reg.engine_id)
        beats._thread.join(3.0)
        assert not beats.alive and beats.error is not None and beats.error.code == "NOT_FOUND"
    finally:
        beats.stop()
