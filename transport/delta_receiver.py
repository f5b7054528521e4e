"""A far engine's end of the delta stream (`transport.delta_stream`, whose docstring has the
protocol): pull a version, rebuild it from the version held, check every bucket's SHA-256,
load it, ack."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transport.base import (
    OnBucket,
    TransferError,
    WeightReceiver,
    unpack,
)
from transport.delta_codec import decode_bucket, layout_key, planes_of
from transport.delta_wire import (
    MAX_HEADER,
    NotKept,
    frame_bound,
    optional_int,
    read_json,
    read_message,
    send_json,
)
from transport.manifest import Manifest, ManifestError, bucket_layout

log = logging.getLogger("transport.delta_stream")


@dataclass
class _Received:
    version: int
    base: int | None
    manifest: Manifest
    sha256: list[str]
    frames: list[bytes] = field(default_factory=list)


class DeltaStreamReceiver(WeightReceiver):
    """A far engine's end of the delta stream: pulls versions, rebuilds and checks them, and
    loads them bucket by bucket (module docstring).

    Args:
        host, port: the sender's address.
        name: this engine's name, sent with every request (1..200 characters).
        timeout_s: seconds the connection, and each read of a version, may take.

    Attributes:
        held_version: the version loaded last (None: none, or a load that failed part-way).
    """

    def __init__(
        self, host: str, port: int, name: str = "engine", timeout_s: float = 300.0
    ) -> None:
        self.host, self.port, self.name, self.timeout_s = host, port, name, timeout_s
        self._sock: socket.socket | None = None
        self._held: tuple[int, bytes, list[np.ndarray]] | None = None

    @property
    def held_version(self) -> int | None:
        """See the class docstring."""
        return self._held[0] if self._held else None

    def receive(self, manifest: Manifest, on_bucket: OnBucket) -> None:
        """See `WeightReceiver.receive`: pulls exactly `manifest.version`.

        Raises:
            ManifestError: the sender's manifest differs from `manifest`.
            TransferError: the version is not kept any more, the stream broke or timed out, a
                frame was malformed or rebuilt with the wrong SHA-256, or `on_bucket` raised.
        """
        self._pull(manifest.version, manifest, on_bucket)

    def receive_newest(self, on_bucket: OnBucket) -> Manifest:
        """Pull the newest version above the one held (waiting up to `timeout_s` for one),
        load it, and return its manifest.

        Raises:
            TransferError: as `receive`.
        """
        return self._pull(None, None, on_bucket)

    def close(self) -> None:
        """Close the connection (the sender drops this engine)."""
        self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _pull(self, want: int | None, expect: Manifest | None, on_bucket: OnBucket) -> Manifest:
        try:
            if self._sock is None:
                self._sock = socket.create_connection((self.host, self.port), self.timeout_s)
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.settimeout(self.timeout_s)
            send_json(self._sock, {"engine": self.name, "holds": self.held_version,
                                    "want": want})  # fmt: skip
            got = self._read_version(self._sock)
        except NotKept:
            raise
        except (OSError, TransferError) as e:
            self._drop()
            raise TransferError(f"{self.name}: the delta stream from {self.host}:{self.port} "
                                f"broke: {e}") from e  # fmt: skip
        try:
            if expect is not None:
                expect.check_offered(got.manifest.fingerprint())
            raws = self._rebuild(got)
        except (TransferError, ManifestError) as e:
            self._ack({"refused": f"{type(e).__name__}: {e}"[:2000]})
            raise
        m = got.manifest
        for b, bucket in enumerate(m.buckets()):
            try:
                import torch

                on_bucket(unpack(m, bucket, torch.from_numpy(raws[b])))
            except Exception as e:
                self._held = None  # part of a version is loaded: the next one is a keyframe
                self._ack({"refused": f"loading failed: {e!r}"[:2000]})
                raise TransferError(f"loading version {m.version} failed: {e!r}") from e
        self._held = (m.version, layout_key(m), raws)
        self._ack({"loaded": m.version})
        return m

    def _ack(self, msg: dict[str, Any]) -> None:
        """Tell the sender; a stream that broke meanwhile is dropped (the next pull
        reconnects and says what this engine holds)."""
        if self._sock is None:
            return
        try:
            send_json(self._sock, msg)
        except OSError as e:
            log.warning("%s: the ack %s was not delivered: %s", self.name, msg, e)
            self._drop()

    def _read_version(self, sock: socket.socket) -> _Received:
        """The header and every frame of one version, checked for shape but not decoded.

        Raises:
            NotKept: the sender does not keep the wanted version.
            TransferError: a malformed header, a length over its
                bound (the stream cannot be resynchronised: the caller drops it).
        """
        h = read_json(sock, MAX_HEADER, "version header")
        if "error" in h:
            raise NotKept(f"the sender: {str(h['error'])[:2000]}")
        try:
            m = Manifest.from_dict(h["manifest"])
            version, base = int(h["version"]), optional_int(h, "base", "version header")
            sha256, sizes = [str(x) for x in h["sha256"]], [int(x) for x in h["sizes"]]
        except (KeyError, TypeError, ValueError, ManifestError) as e:
            raise TransferError(f"malformed version header: {e!r}") from e
        buckets = m.buckets()
        if version != m.version or not len(sha256) == len(sizes) == len(buckets):
            raise TransferError(
                f"version header: version {version} (manifest {m.version}), {len(sha256)} "
                f"hashes and {len(sizes)} sizes for {len(buckets)} buckets"
            )
        got = _Received(version, base, m, sha256)
        for b, bucket in enumerate(buckets):
            bound = min(sizes[b], frame_bound(bucket_layout(m, bucket)[1]))
            frame = read_message(sock, bound, f"bucket {b} of version {version}")
            if len(frame) != sizes[b]:
                raise TransferError(f"bucket {b} of version {version}: {len(frame)} bytes, "
                                    f"the header said {sizes[b]}")  # fmt: skip
            got.frames.append(frame)
        return got

    def _rebuild(self, got: _Received) -> list[np.ndarray]:
        m, held = got.manifest, self._held
        if got.base is not None and (
            held is None or held[0] != got.base or held[1] != layout_key(m)
        ):
            raise TransferError(
                f"version {got.version} is a delta against version {got.base}; this engine "
                f"holds {held[0] if held else None}"
            )
        bases = held[2] if got.base is not None and held is not None else None
        return [
            decode_bucket(
                frame,
                bases[b] if bases is not None else None,
                planes_of(m, bucket),
                bucket_layout(m, bucket)[1],
                got.sha256[b],
                f"bucket {b} of version {got.version} (base {got.base})",
            )  # fmt: skip
            for b, (frame, bucket) in enumerate(zip(got.frames, m.buckets(), strict=True))
        ]
