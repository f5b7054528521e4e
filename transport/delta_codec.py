"""One bucket as a compressed XOR delta (or a compressed keyframe): the encoding both delta
data planes share, the shared folder (`transport.file_delta`) and the TCP stream per far
engine (`transport.delta_stream`).

A bucket is the packed uint8 buffer of the other transports (`transport.base.iter_packed`).
Its **delta** against a base version's buffer is their XOR, so a value a train step left
unchanged is zero in every byte; each tensor's values are then regrouped by byte significance
(all first bytes, then all second bytes, ...: Blosc's "shuffle" filter) so the planes that
rarely change compress to almost nothing, and zstd compresses the result. A **keyframe** is
the same without the XOR. XOR is its own inverse, so the receiver rebuilds the version bit for
bit from the base it holds, and checks the rebuilt buffer's SHA-256 against the sender's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from transport.base import TransferError
from transport.manifest import DTYPE_BYTES, Manifest, bucket_layout

Planes = list[tuple[int, int, int]]
"""(offset, bytes, itemsize) of each tensor's values inside a bucket's packed buffer."""


def layout_key(manifest: Manifest) -> bytes:
    """What two versions must share for one to be a delta of the other: every tensor's name,
    shape, dtype and the bucket size (the manifest but its version)."""
    return dataclasses.replace(manifest, version=0).to_json()


def planes_of(manifest: Manifest, bucket: list[int]) -> Planes:
    """The `Planes` of the bucket holding the tensors `bucket` (indices into the manifest)."""
    offsets, _ = bucket_layout(manifest, bucket)
    return [
        (off, manifest.tensors[i].nbytes, DTYPE_BYTES[manifest.tensors[i].dtype])
        for i, off in zip(bucket, offsets, strict=True)
    ]


def shuffle(buf: np.ndarray, planes: Planes) -> np.ndarray:
    """uint8 [N] -> uint8 [N]: each tensor's values regrouped by byte significance (all
    first bytes, then all second bytes, ...); the padding between tensors stays in place."""
    out = buf.copy()
    for off, n, size in planes:
        if size > 1:
            out[off : off + n] = buf[off : off + n].reshape(-1, size).T.reshape(-1)
    return out


def unshuffle(buf: np.ndarray, planes: Planes) -> np.ndarray:
    """Inverse of `shuffle`."""
    out = buf.copy()
    for off, n, size in planes:
        if size > 1:
            out[off : off + n] = buf[off : off + n].reshape(size, -1).T.reshape(-1)
    return out


def digest(raw: np.ndarray) -> str:
    """The SHA-256 (hex) of a packed bucket, uint8 [N]."""
    return hashlib.sha256(raw.tobytes()).hexdigest()


def encode_bucket(
    raw: np.ndarray, base: np.ndarray | None, planes: Planes, compressor: Any
) -> bytes:
    """A bucket's bytes on the wire or on disk.

    Args:
        raw: the packed bucket, uint8 [N].
        base: the same bucket of the base version, uint8 [N] (a delta), or None (a keyframe).
        planes: the bucket's `planes_of`.
        compressor: a `zstandard.ZstdCompressor`.

    Returns:
        One zstd frame (its header carries the content size, N bytes).
    """
    body = raw ^ base if base is not None else raw
    return bytes(compressor.compress(shuffle(body, planes).tobytes()))


def decode_bucket(
    blob: bytes, base: np.ndarray | None, planes: Planes, size: int, sha256: str, where: str
) -> np.ndarray:
    """Inverse of `encode_bucket`, checked: the rebuilt bucket, uint8 [size].

    Args:
        blob: one zstd frame as `encode_bucket` made it.
        base: the base version's bucket, uint8 [size], for a delta; None for a keyframe.
        planes: the bucket's `planes_of`.
        size: the packed bucket's size in bytes (the manifest's); a frame that declares any
            other content size is refused before anything is allocated.
        sha256: the sender's SHA-256 of the bucket (hex).
        where: names the bucket and version in error messages.

    Raises:
        TransferError: a frame that is not zstd or declares another size, a base of another
            size, or a rebuilt bucket whose SHA-256 differs (a corrupt frame, or a base the
            sender did not use).
    """
    import zstandard

    try:
        declared = zstandard.frame_content_size(blob)
    except zstandard.ZstdError as e:
        raise TransferError(f"{where}: not a zstd frame: {e}") from e
    if declared != size:
        raise TransferError(f"{where}: the frame declares {declared} bytes, expected {size}")
    try:
        body = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob), np.uint8)
    except zstandard.ZstdError as e:
        raise TransferError(f"{where}: {e}") from e
    if len(body) != size:
        raise TransferError(f"{where}: {len(body)} bytes after decompression, expected {size}")
    raw = unshuffle(body, planes)
    if base is not None:
        if len(base) != size:
            raise TransferError(f"{where}: the base bucket has {len(base)} bytes, not {size}")
        raw ^= base
    if digest(raw) != sha256:
        raise TransferError(
            f"{where} rebuilt with the wrong SHA-256: a corrupt frame or a base the sender "
            "did not use; nothing loaded"
        )
    return raw
