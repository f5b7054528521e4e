"""Weights as compressed deltas over TCP, one stream per far engine (issue 26 item 5): for
engines behind slow links (another site, a WAN), each version travels as its XOR delta against
the version that engine holds, encoded as the shared-folder plane does it
(`transport.delta_codec`: byte-plane shuffle, zstd, SHA-256 of every rebuilt bucket).

The sender listens on (host, port) and serves every engine that connects on a thread of its
own. An engine *pulls*: it sends a request naming the version it holds (or none) and the
version it wants (or none: the newest); the sender answers with the newest version above the
held one (waiting for one if there is none yet), encoded for that engine alone:

- a **delta** against the held version, when the sender still keeps that version (the newest
  `keep` ones, the one each connected engine holds and the one on its way to it) with the same
  layout (and, when `full_every` is set, the engine has had fewer than `full_every` - 1 deltas
  since its last keyframe: by default deltas follow each other without end, every rebuild
  checked by hash);
- a **keyframe** (the whole version, compressed) otherwise: an engine that holds nothing, too
  old a version, or refused the last one (a corrupt frame, a hash mismatch).

So an engine that cannot keep up skips versions (it always gets the newest, from whatever it
holds) and holds back neither the trainer (`send` packs the version, keeps it and returns: the
version is *handed to the engines' senders*, nothing waits for a link) nor the other engines
(each has its own thread; at most one version is ever in flight to an engine, and the one it
gets next is the newest at the time it asks: a queue of depth one where the newest wins).
Frames encoded for one engine are kept for the next engine with the same base (a keyframe is
compressed once per version).

Wire format (`transport.delta_wire`: every message an 8-byte big-endian length and that many
bytes, each length checked against a bound before it is read). Engine to sender: a JSON
request ``{"engine", "holds", "want"}`` (at most `MAX_REQUEST` bytes), then after each version
a JSON ack ``{"loaded": v}`` or ``{"refused": reason}``. Sender to engine: a JSON header
``{"version", "base", "manifest", "sha256", "sizes"}`` (at most `MAX_HEADER` bytes; ``base``
null for a keyframe) followed by one message per bucket (one zstd frame, of the header's size,
at most `frame_bound` of the bucket), or ``{"error": reason}`` (a wanted version the sender
no longer keeps). A length over its bound, a malformed message, a broken or stalled
connection (`timeout_s`) ends that engine's stream on either side: the sender drops the engine
(`FarEngine.dropped`), the receiver (`transport.delta_receiver`) raises `TransferError` and
reconnects on its next pull; nothing of a version is loaded unless every bucket was rebuilt
with the sender's SHA-256.

Memory: the sender keeps the newest `keep` versions' packed bytes (the model in the wire dtype
each), the version each connected engine holds and the one on its way to it (at most two more
per engine) and the frames
encoded from them; a receiver keeps the version it loaded, packed.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from transport.base import (
    SendStats,
    TransferError,
    WeightSender,
    iter_packed,
)
from transport.delta_codec import digest, encode_bucket, layout_key, planes_of
from transport.delta_wire import (
    MAX_REQUEST,
    PeerClosed,
    optional_int,
    read_json,
    send_json,
    send_message,
)
from transport.manifest import Manifest, ManifestError

log = logging.getLogger("transport.delta_stream")


@dataclass
class _Kept:
    """One version the sender keeps: its manifest, layout key, packed buckets and hashes."""

    manifest: Manifest
    layout: bytes
    raws: list[np.ndarray]
    sha256: list[str] | None = None  # hashed by the first engine thread that sends it


@dataclass(frozen=True)
class FarPush:
    """One version sent to one far engine.

    Attributes:
        engine: the engine's name (as it sent it) and peer address, ``name@host:port``.
        version: the version sent. base: the version its delta is against; None: keyframe.
        wire_bytes: bytes of the frames sent (compressed). payload_bytes: the version's
            bytes in the wire dtype (full, uncompressed).
        seconds: from the request to the engine's ack (encode, link, rebuild, load).
        encode_s: of `seconds`, the sender's hashing and encoding (0 for frames another
            engine's push already encoded: the CPU a far engine costs the trainer's host).
        loaded: whether the engine loaded it (False: it refused it).
        at: `time.monotonic()` at the ack.
    """

    engine: str
    version: int
    base: int | None
    wire_bytes: int
    payload_bytes: int
    seconds: float
    encode_s: float
    loaded: bool
    at: float


@dataclass
class FarEngine:
    """The sender's view of one connected engine.

    Attributes:
        name: ``name@host:port``. holds: the version it last reported or loaded (None: none).
        since_keyframe: deltas it loaded since its last keyframe.
        keyframe_next: its next version is a keyframe (it refused the last one).
        dropped: why its stream ended (None while it is served).
        pulling: the version on its way to it (None: none); kept like `holds`, since it
            becomes the base of its next delta once loaded (a pull stalled on a cut link
            while newer versions arrive must not end in a keyframe).
    """

    name: str
    holds: int | None = None
    pulling: int | None = None
    since_keyframe: int = 0
    keyframe_next: bool = False
    dropped: str | None = None


class DeltaStreamSender(WeightSender):
    """Serves each far engine the newest version as a delta or keyframe (module docstring).

    Args:
        host: the address to listen on ("0.0.0.0": every interface).
        port: the TCP port; 0 picks a free one (read `port`).
        keep: newest versions kept as delta bases (>= 1), besides the one each connected
            engine holds and the one on its way to it.
        full_every: a keyframe to an engine after every `full_every` - 1 deltas (>= 1); 0:
            only when needed (the engine holds no kept version, or refused the last one).
        level: zstd compression level (1..22).
        timeout_s: seconds a write to an engine, or its ack, may take before it is dropped.

    Attributes:
        port: the port listened on. engines: every engine that connected, by connection.
        pushes: every version sent to an engine, in order.

    Raises:
        ValueError: an argument out of its range.
        OSError: the address cannot be listened on.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        keep: int = 2,
        full_every: int = 0,
        level: int = 3,
        timeout_s: float = 300.0,
    ) -> None:
        if keep < 1 or full_every < 0 or not 1 <= level <= 22 or timeout_s <= 0:
            raise ValueError(
                f"need keep >= 1, full_every >= 0, 1 <= level <= 22, timeout_s > 0; got {keep}, "
                f"{full_every}, {level}, {timeout_s}"
            )
        self.keep, self.full_every, self.level, self.timeout_s = keep, full_every, level, timeout_s
        self._listener = socket.create_server((host, port))
        self.port: int = self._listener.getsockname()[1]
        self.engines: list[FarEngine] = []
        self.pushes: list[FarPush] = []
        self._cv = threading.Condition()
        self._kept: dict[int, _Kept] = {}
        self._frames: dict[tuple[int | None, int], list[bytes]] = {}
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._busy = 0  # versions chosen for an engine whose push is not recorded yet
        self._acceptor = threading.Thread(target=self._accept, name="far-accept", daemon=True)
        self._acceptor.start()

    @property
    def newest(self) -> int | None:
        """The newest version handed over (None before the first `send`)."""
        with self._cv:
            return max(self._kept, default=None)

    @property
    def kept(self) -> list[int]:
        """The versions kept now (delta bases and versions to serve), ascending."""
        with self._cv:
            return sorted(self._kept)

    def send(self, manifest: Manifest, tensors: Iterable[tuple[str, Any]]) -> SendStats:
        """Pack the version, keep it and hand it to every engine's stream; returns at once
        (no engine is waited for; hashing and encoding run on the engines' threads).
        `SendStats.wire_bytes` is None: each engine's bytes are in `pushes`. A version kept
        already (the trainer re-planning it for an engine that came back) is left as it is.

        Raises:
            ManifestError: a name, order or shape that differs from the manifest, or a
                sharded manifest (this transport sends whole tensors).
            ValueError: `manifest.version` not above the newest version sent.
            TransferError: the sender is closed.
        """
        t0 = time.perf_counter()
        if manifest.sharded:
            raise ManifestError("the delta stream sends whole tensors; got a sharded manifest")
        with self._cv:
            again = self._kept.get(manifest.version)
        if again is not None:  # a re-plan or catch-up of a version handed over already
            if again.layout != layout_key(manifest):
                raise ManifestError(f"version {manifest.version} is kept with another layout")
            return SendStats(manifest.version, manifest.total_bytes, len(again.raws), 0.0,
                             phases={"pack_s": 0.0})  # fmt: skip
        raws = [packed.numpy() for packed in iter_packed(manifest, tensors)]
        kept = _Kept(manifest, layout_key(manifest), raws)
        with self._cv:
            if self._closed:
                raise TransferError("the delta stream sender is closed")
            newest = max(self._kept, default=-1)
            if manifest.version <= newest:
                raise ValueError(f"version: expected > {newest}, got {manifest.version}")
            self._kept[manifest.version] = kept
            held = {v for e in self.engines if e.dropped is None for v in (e.holds, e.pulling)}
            for v in sorted(self._kept)[: -self.keep]:
                if v not in held:  # a connected engine's base (or next base) stays: deltas
                    del self._kept[v]
            self._frames = {k: f for k, f in self._frames.items() if k[1] in self._kept}
            self._cv.notify_all()
        seconds = time.perf_counter() - t0
        return SendStats(
            manifest.version, manifest.total_bytes, len(raws), seconds, phases={"pack_s": seconds}
        )

    def close(self) -> None:
        """Stop listening, end every engine's stream and join every thread."""
        with self._cv:
            self._closed = True
            conns = list(self._conns)
            self._cv.notify_all()
        for s in [self._listener, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._acceptor.join(self.timeout_s)
        for t in list(self._threads):
            t.join(self.timeout_s)

    # ----- threads -----
    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return  # closed
            with self._cv:
                if self._closed:
                    conn.close()
                    return
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._conns.append(conn)
                t = threading.Thread(
                    target=self._serve, args=(conn, f"{addr[0]}:{addr[1]}"), daemon=True,
                    name=f"far-send-{addr[0]}:{addr[1]}",
                )  # fmt: skip
                self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        engine = FarEngine(name=f"?@{peer}")
        with self._cv:
            self.engines.append(engine)
        try:
            while True:
                conn.settimeout(None)  # an engine asks when it is ready; close() wakes this
                req = read_json(conn, MAX_REQUEST, f"request of {engine.name}")
                conn.settimeout(self.timeout_s)
                name = req.get("engine")
                if not isinstance(name, str) or not 0 < len(name) <= 200:
                    raise TransferError(f"request of {engine.name}: bad engine name {name!r}")
                engine.name = f"{name}@{peer}"
                holds = optional_int(req, "holds", engine.name)
                want = optional_int(req, "want", engine.name)
                if holds != engine.holds:
                    engine.holds, engine.since_keyframe = holds, 0
                if not self._serve_one(conn, engine, want):
                    return
        except PeerClosed:
            engine.dropped = "closed by the engine"
            log.info("far engine %s hung up", engine.name)
        except (OSError, TransferError) as e:
            if not self._closed:
                engine.dropped = f"{type(e).__name__}: {e}"
                log.warning("far engine %s dropped: %s", engine.name, engine.dropped)
        finally:
            engine.dropped = engine.dropped or "closed"
            with self._cv:
                if conn in self._conns:
                    self._conns.remove(conn)
            conn.close()

    def _serve_one(self, conn: socket.socket, engine: FarEngine, want: int | None) -> bool:
        """Send one version to `engine` and read its ack; False once the sender is closed."""
        t0 = time.monotonic()
        with self._cv:
            while not self._closed and not self._ready(engine, want):
                self._cv.wait()
            if self._closed:
                return False
            if want is not None and want not in self._kept:
                send_json(conn, {"error": f"version {want} is not kept (kept: "
                                           f"{sorted(self._kept)})"})  # fmt: skip
                return True
            version = want if want is not None else max(self._kept)
            self._busy += 1
            engine.pulling = version
            kept = self._kept[version]
            base = engine.holds
            delta = (
                base is not None and base in self._kept and base < version
                and self._kept[base].layout == kept.layout and not engine.keyframe_next
                and (not self.full_every or engine.since_keyframe + 1 < self.full_every)
            )  # fmt: skip
            base_kept = self._kept[base] if delta and base is not None else None
            key = (base if delta else None, version)
        try:
            self._send_version(conn, engine, version, kept, base_kept, key, t0)
        finally:
            with self._cv:
                self._busy -= 1
                engine.pulling = None
                self._cv.notify_all()
        return True

    def _send_version(
        self, conn: socket.socket, engine: FarEngine, version: int, kept: _Kept,
        base_kept: _Kept | None, key: tuple[int | None, int], t0: float,
    ) -> None:  # fmt: skip
        """Encode (or take from the cache), send, read the ack, record the push."""
        with self._cv:
            frames = self._frames.get(key)
        t_enc = time.monotonic()
        if kept.sha256 is None:
            kept.sha256 = [digest(r) for r in kept.raws]
        if frames is None:
            frames = self._encode(kept, base_kept)
            with self._cv:
                if version in self._kept:
                    self._frames[key] = frames
        encode_s = time.monotonic() - t_enc
        delta = key[0] is not None
        header = {"version": version, "base": key[0], "manifest": kept.manifest.to_dict(),
                  "sha256": kept.sha256, "sizes": [len(f) for f in frames]}  # fmt: skip
        send_json(conn, header)
        for f in frames:
            send_message(conn, f)
        try:
            ack = read_json(conn, MAX_REQUEST, f"ack of {engine.name}")
        except PeerClosed:
            raise TransferError(f"it hung up before acking version {version}") from None
        loaded = ack.get("loaded") == version
        if loaded:
            engine.holds, engine.keyframe_next = version, False
            engine.since_keyframe = engine.since_keyframe + 1 if delta else 0
        else:
            engine.keyframe_next = True
            log.warning("far engine %s refused version %d: %s", engine.name, version,
                        str(ack.get("refused"))[:500])  # fmt: skip
        with self._cv:
            self.pushes.append(
                FarPush(engine.name, version, key[0], sum(map(len, frames)),
                        kept.manifest.total_bytes, time.monotonic() - t0, encode_s, loaded,
                        time.monotonic())
            )  # fmt: skip

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no version is on its way to an engine (every ack read and its push
        recorded in `pushes`), at most `timeout_s` seconds; returns whether it is so."""
        with self._cv:
            return self._cv.wait_for(lambda: self._busy == 0, timeout_s)

    def _ready(self, engine: FarEngine, want: int | None) -> bool:
        if want is not None:
            return want in self._kept or want < max(self._kept, default=-1)
        newest = max(self._kept, default=None)
        return newest is not None and (engine.holds is None or newest > engine.holds)

    def _encode(self, kept: _Kept, base: _Kept | None) -> list[bytes]:
        import zstandard

        compressor = zstandard.ZstdCompressor(level=self.level)
        m = kept.manifest
        return [
            encode_bucket(raw, base.raws[b] if base else None, planes_of(m, bucket), compressor)
            for b, (raw, bucket) in enumerate(zip(kept.raws, m.buckets(), strict=True))
        ]
