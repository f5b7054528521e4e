"""What a weight version is made of: a manifest of tensors and its partition into buckets.

A `Manifest` names every tensor of one version (HF checkpoint names, full shapes, the wire
dtype) and the bucket size in bytes. Both ends compute the same partition into buckets from
it (`Manifest.buckets`), so only the manifest itself ever needs to be agreed on. Pure Python:
no torch, numpy or JAX at import time, so an engine reads its sync plan before any ML library
loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from mappings.shards import SHARD_KINDS, Region, ShardKind, tp_slice
from transport.adapter_spec import AdapterSpec

# Bytes per element of each wire dtype, named as torch names them (`torch.<name>`).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


FINGERPRINT_BYTES = 5 * 8 + 32
"""Length of `Manifest.fingerprint`: five int64 fields and a SHA-256 digest."""


Box = tuple[tuple[int, int], ...]
"""A block of a full tensor: one `(start, stop)` per dim."""

Source = tuple[int, Box]
"""Who sends a block of a tensor: `(sender rank, box)` (`Manifest.sources`)."""


class ManifestError(ValueError):
    """A manifest, or a tensor checked against one, is malformed or does not fit."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a version.

    Attributes:
        name: HF checkpoint name, e.g. `model.layers.0.self_attn.q_proj.weight`.
        shape: full (unsharded) shape, e.g. `(num_heads * head_dim, hidden)`.
        dtype: wire dtype as torch names it (`"bfloat16"`, `"float32"`, ...), a key of
            `DTYPE_BYTES`.
        shard: how the engine's tensor parallelism splits it (`transport.reshard`);
            used only when the manifest's `tp_size` > 1.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    shard: ShardKind = "replicated"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ManifestError(
                f"tensor {self.name!r}: dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}"
            )
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ManifestError(
                f"tensor {self.name!r}: shape must be non-negative ints, got {self.shape}"
            )
        if self.shard not in SHARD_KINDS:
            raise ManifestError(
                f"tensor {self.name!r}: shard {self.shard!r} is not one of {SHARD_KINDS}"
            )

    @property
    def nbytes(self) -> int:
        """Size in bytes: `prod(shape) * DTYPE_BYTES[dtype]`."""
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Manifest:
    """Every tensor of one weight version, in sending order, and the bucket size.

    Attributes:
        version: the weight version these tensors make up (an int >= 0).
        tensors: the tensors in the order the sender yields them; names are unique.
        bucket_bytes: upper bound in bytes of one bucket; a tensor larger than it travels
            alone in its own bucket (so the extra memory on each side is at most
            `max(bucket_bytes, largest tensor)`).
        tp_size: the receiving engines' TP degree when each TP rank gets only its own shard
            of every non-replicated tensor (`TensorSpec.shard`); 1 sends every tensor whole
            to every rank.
        num_kv_heads: the model's KV heads (needed when a tensor's shard is `kv`).
        senders: how many trainer processes send the version (group ranks 0..senders-1);
            above 1 each sends only the blocks it holds (`transport.fan_in`).
        sources: with `senders` > 1, per tensor (in `tensors` order) the blocks that make it
            up: `(sender, box)` pairs, a box being one `(start, stop)` per dim of the full
            shape; the boxes tile the tensor exactly once. An empty entry: sender 0 sends
            the whole tensor.
    """

    version: int
    tensors: tuple[TensorSpec, ...]
    bucket_bytes: int
    tp_size: int = 1
    num_kv_heads: int = 0
    senders: int = 1
    sources: tuple[tuple[Source, ...], ...] = ()
    adapter: AdapterSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or self.version < 0:
            raise ManifestError(f"version must be an int >= 0, got {self.version!r}")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes <= 0:
            raise ManifestError(f"bucket_bytes must be an int > 0, got {self.bucket_bytes!r}")
        counts = Counter(t.name for t in self.tensors)
        dupes = sorted(n for n, c in counts.items() if c > 1)
        if dupes:
            raise ManifestError(f"manifest names must be unique; repeated: {dupes}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ManifestError(f"tp_size must be an int >= 1, got {self.tp_size!r}")
        if self.tp_size > 1:
            for t in self.tensors:
                try:
                    tp_slice(t.shape, t.shard, self.tp_size, 0, self.num_kv_heads or None)
                except ValueError as e:
                    raise ManifestError(
                        f"tensor {t.name!r} {list(t.shape)} cannot be split {t.shard!r} over "
                        f"tp_size {self.tp_size} (num_kv_heads {self.num_kv_heads}): {e}"
                    ) from e
        self._check_sources()

    def _check_sources(self) -> None:
        if not isinstance(self.senders, int) or self.senders < 1:
            raise ManifestError(f"senders must be an int >= 1, got {self.senders!r}")
        if not self.sources:
            return
        if len(self.sources) != len(self.tensors):
            raise ManifestError(
                f"sources: expected one entry per tensor ({len(self.tensors)}), got "
                f"{len(self.sources)}"
            )
        for t, entry in zip(self.tensors, self.sources, strict=True):
            if not entry:
                continue
            volume = 0
            for sender, box in entry:
                if not 0 <= sender < self.senders or len(box) != len(t.shape) or any(
                    not 0 <= a < b <= d for (a, b), d in zip(box, t.shape, strict=True)
                ):  # fmt: skip
                    raise ManifestError(
                        f"tensor {t.name!r} {list(t.shape)}: source ({sender}, {list(box)}) is "
                        f"not a non-empty box of it from a sender in 0..{self.senders - 1}"
                    )
                volume += math.prod(b - a for a, b in box)
            boxes = [box for _, box in entry]
            overlapping = any(
                all(max(a0, a1) < min(b0, b1) for (a0, b0), (a1, b1) in zip(x, y, strict=True))
                for k, x in enumerate(boxes) for y in boxes[k + 1 :]
            )  # fmt: skip
            if overlapping or volume != math.prod(t.shape):
                raise ManifestError(
                    f"tensor {t.name!r} {list(t.shape)}: its sources do not tile it exactly "
                    f"once ({volume} of {math.prod(t.shape)} elements, overlapping: "
                    f"{overlapping})"
                )

    @property
    def sharded(self) -> bool:
        """Whether each TP rank receives only its own shard (`tp_size` > 1)."""
        return self.tp_size > 1

    def region(self, i: int, tp_rank: int) -> Region:
        """The part of tensor `i`'s full shape that TP rank `tp_rank` receives (all of it
        when the manifest is not sharded or the tensor is replicated)."""
        t = self.tensors[i]
        if not self.sharded:
            return tuple(slice(0, d) for d in t.shape)
        return tp_slice(t.shape, t.shard, self.tp_size, tp_rank, self.num_kv_heads or None)

    @property
    def total_bytes(self) -> int:
        """Sum of every tensor's `nbytes`."""
        return sum(t.nbytes for t in self.tensors)

    def buckets(self) -> list[list[int]]:
        """Partition the tensors, in order, into buckets of at most `bucket_bytes`.

        Greedy: a tensor joins the current bucket if it still fits, else it opens a new one.

        Returns:
            A list of buckets, each a non-empty list of indices into `tensors`.
        """
        out: list[list[int]] = []
        size = 0
        for i, t in enumerate(self.tensors):
            if out and size + t.nbytes <= self.bucket_bytes:
                out[-1].append(i)
                size += t.nbytes
            else:
                out.append([i])
                size = t.nbytes
        return out

    def to_dict(self) -> dict:
        """A JSON-ready dict (the form carried by vLLM's update request and the gateway).

        A sharded manifest adds `tp_size`, `num_kv_heads` and each tensor's shard kind; a
        manifest of several senders adds `senders`, and one that names its blocks `sources`;
        an adapter-only one adds `adapter` (PEFT's `r`, `lora_alpha`, `target_modules`).
        """
        if not self.sharded:
            d = {
                "version": self.version,
                "bucket_bytes": self.bucket_bytes,
                "tensors": [[t.name, list(t.shape), t.dtype] for t in self.tensors],
            }
        else:
            d = {
                "version": self.version,
                "bucket_bytes": self.bucket_bytes,
                "tp_size": self.tp_size,
                "num_kv_heads": self.num_kv_heads,
                "tensors": [[t.name, list(t.shape), t.dtype, t.shard] for t in self.tensors],
            }
        if self.senders > 1:
            d["senders"] = self.senders
        if self.sources:
            d["sources"] = [[[s, [list(r) for r in box]] for s, box in e] for e in self.sources]
        if self.adapter is not None:
            d["adapter"] = self.adapter.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        """Inverse of `to_dict`. Raises `ManifestError` on a missing or malformed field."""
        try:
            tensors = tuple(
                TensorSpec(str(n), tuple(int(x) for x in s), str(dt), *(str(k) for k in rest))  # type: ignore[arg-type]
                for n, s, dt, *rest in d["tensors"]
            )
            sources = tuple(
                tuple((int(s), tuple((int(a), int(b)) for a, b in box)) for s, box in e)
                for e in d.get("sources", ())
            )
            return cls(
                int(d["version"]),
                tensors,
                int(d["bucket_bytes"]),
                int(d.get("tp_size", 1)),
                int(d.get("num_kv_heads", 0)),
                int(d.get("senders", 1)),
                sources,
                AdapterSpec.from_dict(d["adapter"]) if "adapter" in d else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(f"malformed manifest dict: {e!r}") from e

    def to_json(self) -> bytes:
        """Canonical UTF-8 JSON bytes (sorted keys), used on the wire and for equality."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Inverse of `to_json`."""
        return cls.from_dict(json.loads(data.decode()))

    def fingerprint(self) -> bytes:
        """What stands for the manifest on the data plane, `FINGERPRINT_BYTES` (72) bytes:
        version, number of tensors, bucket_bytes, tp_size and num_kv_heads (int64 little
        endian each), then the SHA-256 of `to_json()`.

        The manifest itself travels once, in the sync plan (control plane); the sender offers
        only this, and each receiver compares it with its own manifest's (`check_offered`).
        """
        head = struct.pack(
            "<5q", self.version, len(self.tensors), self.bucket_bytes, self.tp_size,
            self.num_kv_heads,
        )  # fmt: skip
        return head + hashlib.sha256(self.to_json()).digest()

    def check_offered(self, offered: bytes) -> None:
        """Check that the fingerprint the sender offered is this manifest's.

        Raises:
            ManifestError: it is not; the message gives both sides' version, number of
                tensors, bucket size and TP degree (and says so when only the tensors'
                names, shapes, dtypes or shard kinds differ).
        """
        mine = self.fingerprint()
        if offered == mine:
            return
        got, want = _describe(offered), _describe(mine)
        what = got if got != want else f"{got}, other tensor names/shapes/dtypes/shards"
        raise ManifestError(f"offered manifest ({what}) differs from the expected one ({want})")

    @classmethod
    def of(
        cls,
        version: int,
        shapes: list[tuple[str, tuple[int, ...]]],
        dtype: str,
        bucket_bytes: int,
    ) -> Manifest:
        """A manifest of `(name, full shape)` pairs, all sent as `dtype`."""
        return cls(
            version,
            tuple(TensorSpec(n, tuple(int(d) for d in s), dtype) for n, s in shapes),
            bucket_bytes,
        )

    def sharded_for(
        self, tp_size: int, shards: Mapping[str, ShardKind], num_kv_heads: int = 0
    ) -> Manifest:
        """The same version sent to engines of TP degree `tp_size`, each TP rank receiving
        only its own shard of every tensor `shards` names (the others go whole).

        Raises:
            ManifestError: a name of `shards` that the manifest lacks, or a tensor that does
                not split over `tp_size`.
        """
        unknown = sorted(set(shards) - {t.name for t in self.tensors})
        if unknown:
            raise ManifestError(f"shard kinds for tensors the manifest lacks: {unknown}")
        tensors = tuple(
            dataclasses.replace(t, shard=shards.get(t.name, "replicated")) for t in self.tensors
        )
        return dataclasses.replace(
            self, tensors=tensors, tp_size=tp_size, num_kv_heads=num_kv_heads
        )


def _describe(fingerprint: bytes) -> str:
    """A fingerprint's fields in words (or what is wrong with it)."""
    if len(fingerprint) != FINGERPRINT_BYTES:
        return f"{len(fingerprint)} bytes, not a manifest fingerprint"
    version, n, bucket, tp, _ = struct.unpack("<5q", fingerprint[:40])
    return f"version {version}, {n} tensors, bucket {bucket} B, tp_size {tp}"


def check_manifest(
    manifest: Manifest,
    expected: dict[str, tuple[tuple[int, ...], str]],
    tp_size: int = 1,
    num_kv_heads: int | None = None,
) -> None:
    """Check a manifest against the tensors a model expects, before anything is loaded.

    Args:
        manifest: the version offered.
        expected: name -> (full shape, dtype) of every tensor the receiving model holds.
        tp_size: the receiving engine's TP degree; a sharded manifest must be sharded for it.
        num_kv_heads: the receiving model's KV heads, if known; a sharded manifest with `kv`
            tensors must split them by this count.

    Raises:
        ManifestError: listing every unknown name, missing name, wrong shape and wrong dtype,
            and a manifest sharded for another TP degree.
    """
    problems: list[str] = []
    if manifest.sharded and manifest.tp_size != tp_size:
        problems.append(f"sharded for tp_size {manifest.tp_size}, the engine runs {tp_size}")
    kv_split = manifest.sharded and any(t.shard == "kv" for t in manifest.tensors)
    if kv_split and num_kv_heads is not None and manifest.num_kv_heads != num_kv_heads:
        problems.append(
            f"KV tensors split by {manifest.num_kv_heads} KV heads, the model has {num_kv_heads}"
        )
    names = {t.name for t in manifest.tensors}
    unknown = sorted(names - expected.keys())
    missing = sorted(expected.keys() - names)
    if unknown:
        problems.append(f"unknown names {unknown}")
    if missing:
        problems.append(f"missing names {missing}")
    for t in manifest.tensors:
        if t.name not in expected:
            continue
        shape, dtype = expected[t.name]
        if tuple(shape) != t.shape:
            problems.append(f"{t.name}: shape {list(t.shape)}, expected {list(shape)}")
        if dtype != t.dtype:
            problems.append(f"{t.name}: dtype {t.dtype}, expected {dtype}")
    if problems:
        raise ManifestError(
            f"manifest of version {manifest.version} does not fit the model: " + "; ".join(problems)
        )


# Byte alignment of each tensor inside a packed bucket, so every slice can be viewed as its
# dtype (torch requires the byte offset to be a multiple of the element size).
ALIGN = 16


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of consecutive blocks of `sizes` bytes, each aligned to `ALIGN`, and the
    total (the end of the last block, aligned)."""
    offsets = []
    off = 0
    for n in sizes:
        offsets.append(off)
        off += -(-n // ALIGN) * ALIGN
    return offsets, off


def bucket_layout(manifest: Manifest, bucket: list[int]) -> tuple[list[int], int]:
    """Byte offsets of a bucket's tensors inside one packed buffer, and its total size.

    Args:
        manifest: the version.
        bucket: indices into `manifest.tensors` (one entry of `manifest.buckets()`).

    Returns:
        (offsets, total): `offsets[j]` is where tensor `bucket[j]` starts, aligned to `ALIGN`
        bytes; `total` is the buffer size in bytes (the end of the last tensor, aligned).
    """
    return aligned_offsets([manifest.tensors[i].nbytes for i in bucket])
