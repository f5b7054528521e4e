"""`BackgroundPusher` on its own: versions only increase, the host copy is a copy (the train
step may donate the params right after), a push that cannot be cancelled makes `close` say so
rather than leave a thread behind silently, and a closed pusher refuses offers."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from trainer.publish.background import BackgroundPusher, PusherFailed


class Blocking:
    """Records each push (version, a copy of its params); the push of `block` waits for
    `release` (no `cancel_push`: a push nothing can end early)."""

    def __init__(self, block: int = 0) -> None:
        self.block = block
        self.release = threading.Event()
        self.started = threading.Event()
        self.pushes: list[tuple[int, dict[str, np.ndarray]]] = []

    def push(self, params, version: int) -> None:
        if version == self.block:
            self.started.set()
            self.release.wait(30.0)
        self.pushes.append((version, {k: v.copy() for k, v in params.items()}))


def test_offers_copy_the_params_and_versions_only_increase():
    publisher = Blocking()
    pusher = BackgroundPusher(publisher, committed=3).start()
    params = {"w": np.arange(4, dtype=np.float32)}
    with pytest.raises(ValueError, match="expected > 3"):
        pusher.offer(params, 3)
    pusher.offer(params, 4)
    params["w"][:] = -1.0  # the caller's buffer changes (a donated train state)
    pusher.flush(30.0)
    assert [v for v, _ in publisher.pushes] == [4] and pusher.committed == 4
    np.testing.assert_array_equal(publisher.pushes[0][1]["w"], [0, 1, 2, 3])
    pusher.close()
    with pytest.raises(PusherFailed, match="closed"):
        pusher.offer(params, 5)


def test_close_says_when_a_push_cannot_be_cancelled():
    publisher = Blocking(block=1)
    pusher = BackgroundPusher(publisher).start()
    pusher.offer({"w": np.zeros(2, np.float32)}, 1)
    assert publisher.started.wait(30.0)
    pusher.offer({"w": np.ones(2, np.float32)}, 2)  # queued behind the blocked push
    with pytest.raises(RuntimeError, match="still runs"):
        pusher.close(timeout_s=0.2)
    publisher.release.set()
    pusher.close(timeout_s=30.0)
    assert not pusher.alive
    assert [v for v, _ in publisher.pushes] == [1] and pusher.skipped == [2]
