"""Build the sender or receiver a `TransportConfig` names (one branch per `kind`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transport.base import WeightReceiver, WeightSender
from transport.config import (
    DeltaStreamTransportConfig,
    FileTransportConfig,
    GlooTransportConfig,
    JaxTransferTransportConfig,
    NcclTransportConfig,
    ShmTransportConfig,
    TransportConfig,
)

if TYPE_CHECKING:
    from transport.collective import CollectiveSender
    from transport.jax_transfer import JaxTransferSender


def make_sender(
    cfg: TransportConfig | DeltaStreamTransportConfig, num_receivers: int = 1, senders: int = 1
) -> WeightSender:
    """The trainer side (process 0 of the trainer). Collective kinds bind their rendezvous
    store now (port 0 picks one; read it back from `.port`); `num_receivers` counts receiving
    ranks and `senders` the trainer processes that send together (`transport.fan_in`; both
    ignored for `file`, `shm`, `delta_stream` and `jax_transfer`, whose
    sender is told its receivers per plan or serves whoever connects)."""
    if isinstance(cfg, DeltaStreamTransportConfig):
        from transport.delta_stream import DeltaStreamSender

        return DeltaStreamSender(
            cfg.host, cfg.port, cfg.keep, cfg.full_every, cfg.zstd_level, cfg.timeout_s
        )
    if isinstance(cfg, NcclTransportConfig):
        from transport.nccl import NcclSender

        return NcclSender(
            cfg.host, cfg.port, num_receivers, cfg.timeout_s, cfg.device, cfg.port_count,
            senders,
        )  # fmt: skip
    if isinstance(cfg, GlooTransportConfig):
        from transport.gloo import GlooSender

        return GlooSender(cfg.host, cfg.port, num_receivers, cfg.timeout_s, cfg.port_count, senders)
    if isinstance(cfg, FileTransportConfig) and cfg.delta:
        from transport.file_delta import DeltaFileSender

        return DeltaFileSender(cfg.root, cfg.keep, cfg.full_every, cfg.zstd_level)
    if isinstance(cfg, FileTransportConfig):
        from transport.file import FileSender

        return FileSender(cfg.root, cfg.keep)
    if isinstance(cfg, ShmTransportConfig):
        from transport.shm import ShmSender

        return ShmSender(cfg.root, cfg.keep)
    if isinstance(cfg, JaxTransferTransportConfig):
        from transport.jax_transfer import JaxTransferSender

        return JaxTransferSender(cfg.host, cfg.timeout_s, 0, (), cfg.group)
    raise TypeError(f"expected a TransportConfig, got {type(cfg).__name__}")


def make_co_sender(
    cfg: TransportConfig, rank: int, world_size: int
) -> CollectiveSender | JaxTransferSender:
    """Sender `rank` (>= 1) of a plan that trainer process 0 made (its port or addresses
    filled in `cfg`): another trainer process sending its own blocks (`transport.fan_in`,
    `transport.jax_transfer`; a jax_transfer sender is told its receivers per plan).

    Raises:
        TypeError: `cfg` is a transport with a single sender (file, shm).
    """
    if isinstance(cfg, JaxTransferTransportConfig):
        from transport.jax_transfer import JaxTransferSender

        return JaxTransferSender(cfg.host, cfg.timeout_s, rank, (), cfg.group)
    if isinstance(cfg, NcclTransportConfig):
        from transport.nccl import NcclCoSender

        return NcclCoSender(cfg.host, cfg.port, rank, world_size, cfg.timeout_s, cfg.device)
    if isinstance(cfg, GlooTransportConfig):
        from transport.gloo import GlooCoSender

        return GlooCoSender(cfg.host, cfg.port, rank, world_size, cfg.timeout_s)
    raise TypeError(
        f"only gloo, nccl and jax_transfer have several senders, got {type(cfg).__name__}"
    )


def make_receiver(
    cfg: TransportConfig | DeltaStreamTransportConfig, rank: int = 1, world_size: int = 2
) -> WeightReceiver:
    """The engine side: `rank` in 1..world_size-1 of the group (its pull ids for
    `jax_transfer`; ignored for `file`, `shm` and `delta_stream`)."""
    if isinstance(cfg, DeltaStreamTransportConfig):
        from transport.delta_receiver import DeltaStreamReceiver

        return DeltaStreamReceiver(cfg.host, cfg.port, cfg.name, cfg.timeout_s)
    if isinstance(cfg, NcclTransportConfig):
        from transport.nccl import NcclReceiver

        return NcclReceiver(cfg.host, cfg.port, rank, world_size, cfg.timeout_s, cfg.device)
    if isinstance(cfg, GlooTransportConfig):
        from transport.gloo import GlooReceiver

        return GlooReceiver(cfg.host, cfg.port, rank, world_size, cfg.timeout_s)
    if isinstance(cfg, FileTransportConfig) and cfg.delta:
        from transport.file_delta import DeltaFileReceiver

        return DeltaFileReceiver(cfg.root, cfg.timeout_s)
    if isinstance(cfg, FileTransportConfig):
        from transport.file import FileReceiver

        return FileReceiver(cfg.root, cfg.timeout_s)
    if isinstance(cfg, ShmTransportConfig):
        from transport.shm import ShmReceiver

        return ShmReceiver(cfg.root, cfg.timeout_s)
    if isinstance(cfg, JaxTransferTransportConfig):
        from transport.jax_transfer import JaxTransferReceiver

        return JaxTransferReceiver(cfg.servers, rank, cfg.group, cfg.timeout_s, cfg.host)
    raise TypeError(f"expected a TransportConfig, got {type(cfg).__name__}")
