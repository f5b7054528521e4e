"""The framing of the delta stream (`transport.delta_stream`): every message an 8-byte
big-endian length and that many bytes, each read checked against a bound before anything is
allocated; JSON control messages; the errors both ends raise."""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from transport.base import TransferError

LENGTH = struct.Struct(">Q")
"""The length prefix of every message."""
MAX_REQUEST = 64 * 1024
"""Bytes of an engine's request or ack, at most."""
MAX_HEADER = 64 * 2**20
"""Bytes of a version's header (its manifest included), at most."""


def frame_bound(size: int) -> int:
    """The most bytes a zstd frame of a `size`-byte bucket may take (zstd's own bound,
    ``ZSTD_COMPRESSBOUND``, rounded up); a longer frame is refused unread."""
    return size + size // 128 + 1024


def send_message(sock: socket.socket, payload: bytes) -> None:
    """Write one length-prefixed message (a small one in one write: with Nagle's algorithm a
    second small write would wait for the peer's delayed ACK)."""
    if len(payload) <= MAX_REQUEST:
        sock.sendall(LENGTH.pack(len(payload)) + payload)
    else:
        sock.sendall(LENGTH.pack(len(payload)))
        sock.sendall(payload)


class PeerClosed(TransferError):
    """The peer closed the stream between two messages (a clean hang-up)."""


def _read_exact(sock: socket.socket, n: int, first: bool = False) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0 and got == 0 and first:
            raise PeerClosed("the peer closed the stream")
        if k == 0:
            raise TransferError(f"the peer closed the stream after {got} of {n} bytes")
        got += k
    return bytes(buf)


def read_message(sock: socket.socket, limit: int, what: str) -> bytes:
    """Read one length-prefixed message of at most `limit` bytes.

    Raises:
        PeerClosed: the peer closed the stream before the message began.
        TransferError: the length exceeds `limit` (nothing more is read or allocated), or the
            peer closed the stream inside the message.
        OSError: the socket failed or timed out.
    """
    (n,) = LENGTH.unpack(_read_exact(sock, LENGTH.size, first=True))
    if n > limit:
        raise TransferError(f"{what}: a length prefix of {n} bytes, over the bound of {limit}")
    return _read_exact(sock, n)


def read_json(sock: socket.socket, limit: int, what: str) -> dict[str, Any]:
    """Read one message of at most `limit` bytes holding a JSON object.

    Raises:
        TransferError: as `read_message`, or the message is not a JSON object.
    """
    raw = read_message(sock, limit, what)
    try:
        msg = json.loads(raw)
    except ValueError as e:
        raise TransferError(f"{what}: not JSON: {e}") from e
    if not isinstance(msg, dict):
        raise TransferError(f"{what}: expected a JSON object, got {type(msg).__name__}")
    return msg


def send_json(sock: socket.socket, msg: dict[str, Any]) -> None:
    """Write `msg` as one JSON message."""
    send_message(sock, json.dumps(msg).encode())


def optional_int(msg: dict[str, Any], key: str, what: str) -> int | None:
    """`msg[key]`: None or an int >= 0.

    Raises:
        TransferError: anything else (named with `what`).
    """
    v = msg.get(key)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise TransferError(f"{what}: {key!r} must be null or an int >= 0, got {v!r}")
    return v


class NotKept(TransferError):
    """The sender does not keep the version asked for (the stream stays open)."""
