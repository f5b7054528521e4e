"""A gloo sender process killed in the middle of a version: the receiver fails at once with a
clear error (the broken connection, not its timeout), nothing of the version is committed, its
group is released, and its reused receive buffers are left to what still holds them."""

import multiprocessing
import os
import re
import signal
import time

import pytest
import torch

from transport.base import TransferError
from transport.gloo import GlooReceiver, GlooSender
from transport.manifest import Manifest

SHAPES = [(f"w{i}", (1024, 1024)) for i in range(12)]  # 12 buckets of 4 MiB (fp32)
TIMEOUT_S = 120  # far above the ~1 s this takes, so a loaded host cannot turn a detection into
# a timeout; the test tells them apart by the error's cause, not by the clock


def _manifest() -> Manifest:
    return Manifest.of(1, SHAPES, "float32", 4 << 20)


def _send_forever(ports) -> None:
    """Child: a sender that pushes version 1 (then waits to be killed)."""
    sender = GlooSender("127.0.0.1", 0, 1, timeout_s=TIMEOUT_S)
    ports.put(sender.port)
    tensors = {n: torch.full(s, float(i)) for i, (n, s) in enumerate(SHAPES)}
    sender.send(_manifest(), tensors.items())
    time.sleep(60)


def test_a_sender_killed_mid_version_fails_the_receiver_fast_and_commits_nothing():
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    child = ctx.Process(target=_send_forever, args=(ports,))
    child.start()
    try:
        receiver = GlooReceiver("127.0.0.1", ports.get(timeout=60), 1, 2, timeout_s=TIMEOUT_S)
        receiver.connect()
        loaded: list[str] = []

        def on_bucket(bucket):
            loaded.extend(n for n, _ in bucket)
            if len(loaded) == 1:  # the sender dies while the rest of the version is on its way
                assert child.pid is not None
                os.kill(child.pid, signal.SIGKILL)
                child.join(10)

        with pytest.raises(TransferError, match="receiving version 1 failed") as failed:
            receiver.receive(_manifest(), on_bucket)
        # the broken connection (gloo: "Connection closed by peer" / "reset"), not the timeout
        assert re.search(r"closed|reset", str(failed.value), re.I), failed.value
        assert not re.search(r"timed? ?out", str(failed.value), re.I), failed.value
        assert 1 <= len(loaded) < len(SHAPES)  # the commit never came: the engine keeps its old
        assert receiver._group is None  # released: nothing of the group left waiting
        receiver.close()
    finally:
        child.kill()
        child.join(10)
    assert not child.is_alive() and child.exitcode == -signal.SIGKILL
