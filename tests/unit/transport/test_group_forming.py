"""Forming a collective group when a member never joins: the sender gives up as soon as its
`abandon` check says so (the gateway dropped the member), not after the transport's
`timeout_s`; the receivers that did join fail at once when the sender closes its store;
every failure is a `TransferError`, never torch's own store error (seen in CI: a vLLM engine
SIGKILLed between acking "ready" and joining held the trainer in the process-group
constructor for 300 s, and the run died of `DistStoreError`)."""

import threading
import time

import pytest

from transport.base import TransferError
from transport.collective import STORE_CONNECT_S, announce_join, rendezvous_store
from transport.gloo import GlooReceiver, GlooSender


def _in_thread(fn):
    out: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_sender_gives_up_when_a_member_left_and_the_joined_receiver_fails_at_once():
    sender = GlooSender("127.0.0.1", 0, num_receivers=2, timeout_s=120)
    joined = GlooReceiver("127.0.0.1", sender.port, 1, 3, timeout_s=120)
    thread, got = _in_thread(joined.connect)
    t0 = time.monotonic()
    checks: list[float] = []

    def abandon():
        checks.append(time.monotonic() - t0)
        return "engines ['engine-2'] left" if checks[-1] > 1.0 else None

    with pytest.raises(TransferError) as e:
        sender.connect(abandon)
    waited = time.monotonic() - t0
    assert "ranks [2] never joined (engines ['engine-2'] left)" in str(e.value)
    assert 1.0 < waited < 10.0, waited  # not the 120 s timeout
    assert 3 <= len(checks) <= 8, checks  # every ABANDON_POLL_S (0.5 s)
    sender.close()
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(got["error"], TransferError), got
    assert "forming the group failed" in str(got["error"])


def test_without_abandon_the_timeout_names_the_missing_ranks():
    sender = GlooSender("127.0.0.1", 0, num_receivers=3, timeout_s=1.5)
    joined = GlooReceiver("127.0.0.1", sender.port, 2, 4, timeout_s=30)
    thread, _ = _in_thread(joined.connect)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match=r"ranks \[1, 3\] never joined \(no word from them"):
        sender.connect()
    assert 1.5 <= time.monotonic() - t0 < 10.0
    sender.close()
    thread.join(30)
    assert not thread.is_alive()


def test_a_member_that_announced_but_never_built_its_group_is_a_transfer_error():
    """The narrow race left: a member dies after announcing its join, inside its own
    process-group constructor. The sender's constructor then waits its timeout, and that
    comes back as a `TransferError` (which the publisher pins on the member that left)."""
    sender = GlooSender("127.0.0.1", 0, num_receivers=1, timeout_s=2)
    store = rendezvous_store("127.0.0.1", sender.port, 2, 30, master=False)
    announce_join(store, 1)  # ... and nothing more
    with pytest.raises(TransferError, match="forming the group failed"):
        sender.connect(lambda: None)
    assert sender._group is None
    sender.close()


def test_a_late_joiner_of_a_dropped_group_fails_in_seconds_not_the_timeout():
    """An engine that reaches a plan's connect after the sender dropped that group (the push
    re-planned meanwhile) finds no store: it fails within a few `STORE_CONNECT_S` instead of
    retrying for the transport's `timeout_s` (it was held there past the re-plan's wait for
    "ready" in CI), so it can take the new plan."""
    sender = GlooSender("127.0.0.1", 0, num_receivers=1, timeout_s=120)
    port = sender.port
    sender.close()
    late = GlooReceiver("127.0.0.1", port, 1, 2, timeout_s=300)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="forming the group failed"):
        late.connect()
    assert time.monotonic() - t0 < 4 * STORE_CONNECT_S  # not the 300 s rendezvous limit
    assert late._group is None


def test_a_joined_store_keeps_the_rendezvous_limit_for_its_waits():
    """The short connect limit is for reaching the store only: the client then waits for keys
    up to the transport's `timeout_s`."""
    sender = GlooSender("127.0.0.1", 0, num_receivers=1, timeout_s=120)
    store = rendezvous_store("127.0.0.1", sender.port, 2, 90, master=False)
    assert store.timeout.total_seconds() == 90
    sender.close()
