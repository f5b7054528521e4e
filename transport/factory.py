"""Build the sender or receiver a `TransportConfig` names (one branch per `kind`)."""

from __future__ import annotations

from transport.base import WeightReceiver, WeightSender
from transport.config import (
    FileTransportConfig,
    GlooTransportConfig,
    NcclTransportConfig,
    TransportConfig,
)


def make_sender(cfg: TransportConfig, num_receivers: int = 1) -> WeightSender:
    """The trainer side. Collective kinds bind their rendezvous store now (port 0 picks one;
    read it back from `.port`); `num_receivers` counts receiving ranks (ignored for `file`)."""
    if isinstance(cfg, NcclTransportConfig):
        from transport.nccl import NcclSender

        return NcclSender(
            cfg.host, cfg.port, num_receivers, cfg.timeout_s, cfg.device, cfg.port_count
        )
    if isinstance(cfg, GlooTransportConfig):
        from transport.gloo import GlooSender

        return GlooSender(cfg.host, cfg.port, num_receivers, cfg.timeout_s, cfg.port_count)
    if isinstance(cfg, FileTransportConfig) and cfg.delta:
        from transport.file_delta import DeltaFileSender

        return DeltaFileSender(cfg.root, cfg.keep, cfg.full_every, cfg.zstd_level)
    if isinstance(cfg, FileTransportConfig):
        from transport.file import FileSender

        return FileSender(cfg.root, cfg.keep)
    raise TypeError(f"expected a TransportConfig, got {type(cfg).__name__}")


def make_receiver(cfg: TransportConfig, rank: int = 1, world_size: int = 2) -> WeightReceiver:
    """The engine side: `rank` in 1..world_size-1 of the group (ignored for `file`)."""
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
    raise TypeError(f"expected a TransportConfig, got {type(cfg).__name__}")
