"""Shared by the gloo transport tests: a sender and its receivers on loopback, and running
each end in its own thread (each end is its own process group, as in separate processes)."""

import threading
from collections.abc import Callable

from transport.config import GlooTransportConfig
from transport.factory import make_receiver, make_sender


def gloo_group(num_receivers: int, timeout_s: float = 20.0):
    """A gloo sender for `num_receivers` receivers on 127.0.0.1 (a free port) and the
    receivers of ranks 1..num_receivers; nothing connected yet."""
    cfg = GlooTransportConfig(port=0, timeout_s=timeout_s)
    sender = make_sender(cfg, num_receivers=num_receivers)
    cfg = cfg.model_copy(update={"port": sender.port})
    receivers = [
        make_receiver(cfg, rank=g, world_size=num_receivers + 1)
        for g in range(1, 1 + num_receivers)
    ]
    return sender, receivers


def run_in_threads(fns: list[Callable[[], object]], timeout_s: float = 60.0) -> list[object]:
    """Run each of `fns` in its own thread; returns each one's result or the exception it
    raised, in order (a thread still running after `timeout_s` fails the call)."""
    out: dict[int, object] = {}

    def wrap(i: int, fn: Callable[[], object]) -> None:
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out[i] = e

    threads = [threading.Thread(target=wrap, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"threads {stuck} still running after {timeout_s} s"
    return [out[i] for i in range(len(fns))]
