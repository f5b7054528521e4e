"""Compressed deltas over TCP, one stream per far engine (`transport.delta_stream`), on
loopback with real sockets and threads: each engine gets the newest version as a delta against
what it holds or as a keyframe, bit for bit; a slow engine skips versions and holds back
neither the trainer nor a fast engine; an engine that dies mid-transfer is dropped; a corrupted
delta is refused and a keyframe follows; a hostile length prefix is refused on either side."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time

import pytest
import torch

from tests.unit.transport.test_file_delta import SHAPES, _m, _same_bits, _versions
from transport.base import TransferError
from transport.config import DeltaStreamTransportConfig
from transport.delta_receiver import DeltaStreamReceiver
from transport.delta_stream import DeltaStreamSender
from transport.delta_wire import LENGTH, NotKept, read_message, send_message
from transport.factory import make_receiver, make_sender
from transport.manifest import Manifest, ManifestError


@pytest.fixture
def sender():
    s = DeltaStreamSender(keep=2, full_every=3, timeout_s=10.0)
    yield s
    s.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("far-")]


def _receiver(sender: DeltaStreamSender, name: str, port: int | None = None):
    return DeltaStreamReceiver("127.0.0.1", port or sender.port, name, timeout_s=10.0)


def _newest(receiver: DeltaStreamReceiver) -> tuple[int, dict[str, torch.Tensor]]:
    got: dict[str, torch.Tensor] = {}
    m = receiver.receive_newest(lambda bucket: got.update({n: t.clone() for n, t in bucket}))
    return m.version, got


def _until(cond, timeout_s: float = 10.0) -> None:
    """Wait for `cond()` (a sender thread's view of a hang-up), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the sender did not see it in time"
        time.sleep(0.01)


def _bases(sender: DeltaStreamSender, engine: str) -> list[tuple[int, int | None, bool]]:
    """(version, base, loaded) of every push to `engine`, once the sender has read every ack
    (a receiver returns as soon as it sent its ack)."""
    assert sender.wait_idle(10.0)
    return [(p.version, p.base, p.loaded) for p in sender.pushes if p.engine.startswith(engine)]


def test_each_engine_gets_deltas_against_what_it_holds_and_keyframes_every_full_every(sender):
    weights = _versions(7)
    r = _receiver(sender, "near")
    for v, w in enumerate(weights, start=1):
        stats = sender.send(_m(v), w.items())
        assert stats.version == v and stats.num_bytes == (64 * 32 + 33 + 16 * 16) * 2
        got_v, got = _newest(r)
        assert got_v == v == r.held_version and _same_bits(got, w)
    assert _bases(sender, "near@") == [
        (1, None, True), (2, 1, True), (3, 2, True), (4, None, True), (5, 4, True),
        (6, 5, True), (7, None, True),
    ]  # fmt: skip
    pushes = [p for p in sender.pushes if p.engine.startswith("near@")]
    keyframes = [p.wire_bytes for p in pushes if p.base is None]
    deltas = [p.wire_bytes for p in pushes if p.base is not None]
    assert max(deltas) < 0.5 * min(keyframes)  # 2% of the values changed
    assert all(p.payload_bytes == stats.num_bytes for p in pushes)
    r.close()


def test_by_default_a_keyframe_only_when_the_engine_holds_nothing_kept():
    """full_every=0 (the default): one keyframe, then deltas for as long as the engine keeps
    up, each rebuilt bit for bit; a keyframe again only for an engine whose version the sender
    dropped (it stopped asking while `keep` newer versions came)."""
    sender = DeltaStreamSender(keep=2, timeout_s=10.0)
    try:
        assert sender.full_every == 0
        weights = _versions(14)
        r = _receiver(sender, "far")
        for v in range(1, 12):
            sender.send(_m(v), weights[v - 1].items())
            got_v, got = _newest(r)
            assert got_v == v and _same_bits(got, weights[v - 1])
        assert _bases(sender, "far@") == [(1, None, True)] + [(v, v - 1, True) for v in
                                                              range(2, 12)]  # fmt: skip
        r.close()
        _until(lambda: all(e.dropped for e in sender.engines))
        for v in (12, 13, 14):  # version 11 is no engine's now: beyond keep=2 it goes
            sender.send(_m(v), weights[v - 1].items())
        assert sender.kept == [13, 14]
        back = DeltaStreamReceiver("127.0.0.1", sender.port, "far", timeout_s=10.0)
        back._held = r._held  # the same engine, come back holding version 11
        assert back.held_version == 11
        got_v, got = _newest(back)
        assert got_v == 14 and _same_bits(got, weights[13])
        assert _bases(sender, "far@")[-1] == (14, None, True)
        back.close()
    finally:
        sender.close()


def test_a_slow_engine_skips_versions_without_holding_back_the_trainer_or_a_fast_engine(sender):
    weights = _versions(6)
    fast, slow = _receiver(sender, "fast"), _receiver(sender, "slow")
    sender.send(_m(1), weights[0].items())
    assert _newest(slow)[0] == 1 and _bases(sender, "slow@") == [(1, None, True)]
    for v in range(2, 7):  # the slow engine asks for nothing meanwhile: no send waits for it
        sender.send(_m(v), weights[v - 1].items())
        assert _newest(fast)[0] == v
    # the newest, as a delta against version 1: beyond the newest keep=2, the sender keeps
    # the version each connected engine holds
    v, got = _newest(slow)
    assert v == 6 and _same_bits(got, weights[5])
    assert _bases(sender, "slow@") == [(1, None, True), (6, 1, True)]
    fast.close()
    for v in range(7, 10):  # the slow engine stops asking; versions beyond keep=2 go
        sender.send(_m(v), weights[5].items())
    slow.close()
    _until(lambda: all(e.dropped for e in sender.engines))  # both hang-ups read
    sender.send(_m(10), weights[5].items())
    assert sorted(sender.kept) == [9, 10]
    slow = _receiver(sender, "slow")  # restarted, it holds nothing: a keyframe
    assert _newest(slow)[0] == 10 and _bases(sender, "slow@")[-1] == (10, None, True)
    slow.close()


def test_receive_pulls_exactly_the_planned_version_or_refuses(sender):
    weights = _versions(3)
    for v, w in enumerate(weights, start=1):
        sender.send(_m(v), w.items())
    r = _receiver(sender, "planned")
    got: dict[str, torch.Tensor] = {}
    r.receive(_m(2), lambda bucket: got.update({n: t.clone() for n, t in bucket}))
    assert r.held_version == 2 and _same_bits(got, weights[1])
    with pytest.raises(NotKept, match="version 1 is not kept"):
        r.receive(_m(1), lambda bucket: None)
    with pytest.raises(ManifestError):
        r.receive(Manifest.of(3, SHAPES, "float32", 4096), lambda bucket: None)
    assert r.held_version == 2  # refused before anything was loaded
    r.receive(_m(3), lambda bucket: None)
    # after any refusal the sender sends a keyframe: it cannot tell a bad base from a bad plan
    assert r.held_version == 3 and _bases(sender, "planned@")[-2:] == [
        (3, 2, False),
        (3, None, True),
    ]
    r.close()


def test_a_load_that_fails_part_way_is_followed_by_a_keyframe(sender):
    weights = _versions(3)
    r = _receiver(sender, "e")
    sender.send(_m(1), weights[0].items())
    _newest(r)
    sender.send(_m(2), weights[1].items())

    def fail(bucket) -> None:
        raise RuntimeError("the engine ran out of memory")

    with pytest.raises(TransferError, match="ran out of memory"):
        r.receive_newest(fail)
    assert r.held_version is None  # it holds part of version 2: nothing whole
    v, got = _newest(r)
    assert v == 2 and _same_bits(got, weights[1])
    assert _bases(sender, "e@") == [(1, None, True), (2, 1, False), (2, None, True)]
    r.close()


def test_an_engine_that_dies_mid_transfer_is_dropped_and_the_others_go_on(sender):
    big = [("w", (1024, 1024))]  # 2 MB in bf16: more than the socket buffers hold
    w = {"w": torch.randn(1024, 1024)}
    sender.send(Manifest.of(1, big, "bfloat16", 4 << 20), w.items())
    dying = socket.create_connection(("127.0.0.1", sender.port))
    send_message(dying, b'{"engine": "dying", "holds": null, "want": null}')
    assert len(dying.recv(1000)) > 0  # the transfer has begun
    dying.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    dying.close()  # a reset, as a killed process's socket
    live = _receiver(sender, "live")
    for v in range(2, 5):
        w["w"] += 0.01
        sender.send(Manifest.of(v, big, "bfloat16", 4 << 20), w.items())
        assert _newest(live)[0] == v
    dead = [e for e in sender.engines if e.name.startswith("dying@")]
    assert len(dead) == 1 and re.search("Connection|hung up before", dead[0].dropped or "")
    assert not any(p.engine.startswith("dying@") and p.loaded for p in sender.pushes)
    live.close()


class _CorruptingProxy:
    """A TCP relay between one receiver and the sender that corrupts the first delta it
    relays (a link or a router that corrupts data): `what` "frame" flips a byte in its first
    bucket frame, "hash" a digit of its first bucket's SHA-256 in the header."""

    def __init__(self, port: int, what: str) -> None:
        self.what = what
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream = port
        self.corrupted = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        down, _ = self.listener.accept()
        up = socket.create_connection(("127.0.0.1", self.upstream))

        def requests() -> None:
            try:
                while data := down.recv(65536):
                    up.sendall(data)
            except OSError:
                pass
            with contextlib.suppress(OSError):
                up.shutdown(socket.SHUT_RDWR)  # wakes the relay's read

        threading.Thread(target=requests, daemon=True).start()
        corrupt_next = False
        try:
            while True:
                msg = bytearray(read_message(up, 1 << 30, "relay"))
                if corrupt_next:
                    msg[len(msg) // 2] ^= 0x40
                    self.corrupted += 1
                    corrupt_next = False
                elif msg[:1] == b"{" and b'"base": null' not in msg and not self.corrupted:
                    if self.what == "frame":
                        corrupt_next = b'"version"' in msg
                    elif b'"sha256": ["' in msg:
                        at = msg.index(b'"sha256": ["') + len(b'"sha256": ["')
                        msg[at] = ord("0") if msg[at] != ord("0") else ord("1")
                        self.corrupted += 1
                send_message(down, bytes(msg))
        except (OSError, TransferError):
            pass
        up.close()
        down.close()

    def close(self) -> None:
        self.listener.close()
        self.thread.join(10)


@pytest.mark.parametrize(
    ("what", "error"),
    [("frame", "SHA-256|decompression error"), ("hash", "wrong SHA-256")],
)
def test_a_corrupted_delta_is_refused_and_a_keyframe_follows(sender, what, error):
    weights = _versions(3)
    proxy = _CorruptingProxy(sender.port, what)
    r = _receiver(sender, "far", port=proxy.port)
    sender.send(_m(1), weights[0].items())
    assert _newest(r)[0] == 1
    sender.send(_m(2), weights[1].items())
    with pytest.raises(TransferError, match=error):
        _newest(r)
    assert proxy.corrupted == 1 and r.held_version == 1  # the old version stays whole
    v, got = _newest(r)
    assert v == 2 and _same_bits(got, weights[1])
    assert _bases(sender, "far@") == [(1, None, True), (2, 1, False), (2, None, True)]
    r.close()
    proxy.close()


def test_a_hostile_length_prefix_to_the_sender_drops_only_that_engine(sender):
    weights = _versions(2)
    sender.send(_m(1), weights[0].items())
    hostile = socket.create_connection(("127.0.0.1", sender.port))
    hostile.sendall(LENGTH.pack(2**62))
    assert hostile.recv(10) == b""  # the sender closed it without reading or allocating more
    hostile.close()
    r = _receiver(sender, "honest")
    assert _newest(r)[0] == 1
    dropped = [e.dropped for e in sender.engines if e.dropped and "over the bound" in e.dropped]
    assert len(dropped) == 1
    r.close()


@pytest.mark.parametrize(
    "reply",
    [
        LENGTH.pack(2**62),  # a header "of 4 EiB"
        LENGTH.pack(len(b'{"version": 1, "base": null, "manifest": {}}'))
        + b'{"version": 1, "base": null, "manifest": {}}',  # a header that is not a version
    ],
    ids=["huge-header", "malformed-header"],
)
def test_a_hostile_sender_is_refused_by_the_receiver(reply):
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        read_message(conn, 1 << 16, "request")
        conn.sendall(reply)
        with contextlib.suppress(OSError):
            conn.recv(1)  # until the receiver hangs up
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    r = DeltaStreamReceiver("127.0.0.1", server.getsockname()[1], "victim", timeout_s=10.0)
    with pytest.raises(TransferError, match="over the bound|malformed"):
        r.receive_newest(lambda bucket: None)
    assert r.held_version is None
    t.join(10)
    server.close()


def test_a_frame_longer_than_its_bucket_allows_is_refused_unread():
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:  # a header whose size for bucket 0 exceeds zstd's bound
        conn, _ = server.accept()
        read_message(conn, 1 << 16, "request")
        header = (
            b'{"version": 1, "base": null, "manifest": '
            + _m(1, bucket_bytes=1 << 20).to_json()
            + b', "sha256": ["00"], "sizes": [1099511627776]}'
        )
        send_message(conn, header)
        conn.sendall(LENGTH.pack(1099511627776))
        with contextlib.suppress(OSError):
            conn.recv(1)
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    r = DeltaStreamReceiver("127.0.0.1", server.getsockname()[1], "victim", timeout_s=10.0)
    with pytest.raises(TransferError, match="over the bound"):
        r.receive_newest(lambda bucket: None)
    t.join(10)
    server.close()


def test_the_factory_builds_both_ends_from_one_config():
    cfg = DeltaStreamTransportConfig(keep=2, full_every=2, zstd_level=1, timeout_s=10.0)
    sender = make_sender(cfg)
    assert isinstance(sender, DeltaStreamSender) and sender.port > 0
    try:
        receiver = make_receiver(cfg.model_copy(update={"port": sender.port, "name": "f"}))
        assert isinstance(receiver, DeltaStreamReceiver)
        weights = _versions(3)
        for v, w in enumerate(weights, start=1):
            sender.send(_m(v), w.items())
            got_v, got = _newest(receiver)
            assert got_v == v and _same_bits(got, w)
        assert _bases(sender, "f@") == [(1, None, True), (2, 1, True), (3, None, True)]
        receiver.close()
    finally:
        sender.close()


def test_a_kept_version_handed_over_again_is_left_as_it_is(sender):
    """The trainer re-plans a version (an engine died during its push) or catches a restarted
    engine up with it: the sender keeps what it has; an older version it dropped is refused."""
    weights = _versions(4)
    for v in (1, 2, 3):
        sender.send(_m(v), weights[v - 1].items())
    again = sender.send(_m(3), weights[3].items())  # other bytes: not packed, not kept
    assert (again.version, again.seconds) == (3, 0.0) and sender.kept == [2, 3]
    r = _receiver(sender, "back")
    v, got = _newest(r)
    assert v == 3 and _same_bits(got, weights[2])
    with pytest.raises(ValueError, match="expected > 3, got 1"):
        sender.send(_m(1), weights[0].items())
    with pytest.raises(ManifestError, match="version 3 is kept with another layout"):
        sender.send(_m(3, bucket_bytes=1024), weights[2].items())
    assert sender.kept == [2, 3]
    r.close()


def test_a_version_stalled_on_its_way_stays_the_base_of_the_next_delta():
    """A pull that stalls (a cut link, a slow load: here the engine's load waits) while more
    than `keep` newer versions arrive: the version on its way is kept beside the newest two,
    so once it is loaded the engine gets the newest as a delta against it, not a keyframe."""
    sender = DeltaStreamSender(keep=2, timeout_s=10.0)
    loading, release = threading.Event(), threading.Event()
    try:
        weights = _versions(6)
        r = _receiver(sender, "far")
        sender.send(_m(1), weights[0].items())
        assert _newest(r)[0] == 1
        sender.send(_m(2), weights[1].items())

        def stalled(bucket):  # noqa: ANN001
            loading.set()
            assert release.wait(10.0)

        pull = threading.Thread(target=lambda: r.receive_newest(stalled))
        pull.start()
        assert loading.wait(10.0)
        for v in range(3, 7):  # the trainer goes on: versions 3..6 while 2 is on its way
            sender.send(_m(v), weights[v - 1].items())
        assert sender.kept == [1, 2, 5, 6]  # held, on its way, the newest two
        release.set()
        pull.join(10.0)
        assert r.held_version == 2
        got_v, got = _newest(r)
        assert got_v == 6 and _same_bits(got, weights[5])
        assert _bases(sender, "far@") == [(1, None, True), (2, 1, True), (6, 2, True)]
        r.close()
    finally:
        release.set()
        sender.close()
