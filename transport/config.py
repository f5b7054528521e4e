"""Transport settings, one pydantic model per kind, joined on the `kind` field.

Imports no ML library: the trainer's launcher and the configs load it in milliseconds.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeGuard

from pydantic import BaseModel, Field


class GlooTransportConfig(BaseModel):
    """gloo over TCP (CPUs). The sender hosts the rendezvous at (host, port)."""

    kind: Literal["gloo"] = "gloo"
    host: str = "127.0.0.1"
    """Address of the sender's rendezvous store: the only address the sender listens on (the
    store and its gloo device); "0.0.0.0" listens on every interface."""
    port: int = Field(default=0, ge=0, le=65535)
    """TCP port of the store; 0 lets the sender pick one (then sent to engines)."""
    port_count: int = Field(default=1, ge=1, le=65535)
    """With `port` > 0: the store takes the first free port of port..port+port_count-1."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Seconds allowed for the rendezvous and each collective."""
    bucket_bytes: int = Field(default=256 * 2**20, gt=0)
    """Bucket size in bytes: bounds the extra memory of each side."""
    tp_shards: bool = True
    """Send each engine TP rank only its own shard of every tensor-parallel tensor (when all
    engines run one TP degree > 1); False sends every tensor whole to every rank."""


class NcclTransportConfig(GlooTransportConfig):
    """NCCL (GPUs); same rendezvous as gloo, buckets in device memory."""

    kind: Literal["nccl"] = "nccl"  # type: ignore[assignment]
    device: str = "cuda:0"
    """This side's CUDA device."""


class FileTransportConfig(BaseModel):
    """safetensors files in a folder shared by trainer and engines."""

    kind: Literal["file"] = "file"
    root: str
    """The shared folder."""
    timeout_s: float = 300.0
    """Seconds a receiver waits for a version to be committed."""
    keep: int = Field(default=2, ge=1)
    """Committed versions the sender keeps on disk."""
    bucket_bytes: int = Field(default=256 * 2**20, gt=0)
    """Bucket size in bytes (one file per bucket)."""
    delta: bool = False
    """Write each version as a zstd-compressed XOR delta against the one before it (with a
    keyframe every `full_every` versions; `transport.file_delta`), for far engines."""
    full_every: int = Field(default=10, ge=1)
    """With `delta`: a whole (keyframe) version every this many versions."""
    zstd_level: int = Field(default=3, ge=1, le=22)
    """With `delta`: the zstd compression level."""


class ShmTransportConfig(BaseModel):
    """Shared-memory segments on the trainer's host (`transport.shm`): engines on the same
    machine map each version instead of receiving it over a socket."""

    kind: Literal["shm"] = "shm"
    root: str
    """The segments' folder, on a tmpfs every engine of the host sees (e.g. /dev/shm/...)."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a receiver waits for a version to be committed."""
    keep: int = Field(default=2, ge=1)
    """Committed versions the sender keeps (each is the model's wire bytes in RAM)."""
    bucket_bytes: int = Field(default=256 * 2**20, gt=0)
    """Bucket size in bytes: what one loader call of an engine gets."""


class JaxTransferTransportConfig(BaseModel):
    """`jax.experimental.transfer` between JAX processes (`transport.jax_transfer`): every
    trainer process serves its own blocks, each JAX engine pulls them onto its device."""

    kind: Literal["jax_transfer"] = "jax_transfer"
    host: str = "127.0.0.1"
    """The address each side's transfer server binds to and is reached at."""
    servers: tuple[str, ...] = ()
    """Sender s's transfer server address is `servers[s]` (filled in by the trainer: one
    per trainer process)."""
    group: int = Field(default=0, ge=0)
    """The plan's group generation (filled in per plan: part of every pull id)."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a version may take to arrive whole; a pull no engine takes is dropped then."""
    bucket_bytes: int = Field(default=256 * 2**20, gt=0)
    """Bucket size in bytes (the manifest's; the pull itself moves whole blocks)."""


class DeltaStreamTransportConfig(BaseModel):
    """Compressed XOR deltas over TCP, one stream per far engine (`transport.delta_stream`):
    each engine pulls the newest version as a delta against the one it holds, or a keyframe.
    The main job's `launch.data_plane=delta_stream` (every engine of the run pulls from the
    trainer's sender at launch.data_plane_host:data_plane_port)."""

    kind: Literal["delta_stream"] = "delta_stream"
    host: str = "127.0.0.1"
    """The sender's listening address (and the address engines connect to)."""
    port: int = Field(default=0, ge=0, le=65535)
    """The sender's TCP port; 0 lets it pick one (read the sender's `port`)."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a version may take to reach an engine (encode, link, rebuild, load) before
    the sender drops it; an engine waits as long for a version."""
    keep: int = Field(default=2, ge=1)
    """Newest versions the sender keeps as delta bases (each the model's wire bytes in RAM);
    an engine holding an older one gets a keyframe."""
    full_every: int = Field(default=0, ge=0)
    """A keyframe to an engine after every `full_every` - 1 deltas it loaded; 0: never on a
    schedule, only when the engine holds no version the sender keeps (or refused the last
    one: a hash mismatch, a failed load)."""
    zstd_level: int = Field(default=3, ge=1, le=22)
    """The zstd compression level."""
    bucket_bytes: int = Field(default=64 * 2**20, gt=0)
    """Bucket size in bytes: each bucket is one zstd frame, hashed and checked alone."""
    name: str = Field(default="engine", min_length=1, max_length=200)
    """Receiver side: the engine's name in the sender's records."""


TransportConfig = Annotated[
    GlooTransportConfig
    | NcclTransportConfig
    | FileTransportConfig
    | ShmTransportConfig
    | JaxTransferTransportConfig
    | DeltaStreamTransportConfig,
    Field(discriminator="kind"),
]


def is_collective(cfg: object) -> TypeGuard[GlooTransportConfig]:
    """Whether `cfg` names a collective transport (gloo or NCCL: one group of sender and
    receivers, every member in step), as opposed to one that leaves each version where
    receivers pick it up (file, shm)."""
    return isinstance(cfg, GlooTransportConfig)


def serves_blocks(cfg: object) -> TypeGuard[GlooTransportConfig | JaxTransferTransportConfig]:
    """Whether every trainer process sends its own blocks of each version over `cfg` (gloo,
    NCCL and jax_transfer), rather than process 0 sending gathered params (file, shm)."""
    return isinstance(cfg, GlooTransportConfig | JaxTransferTransportConfig)
