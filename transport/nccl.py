"""Weights over NCCL, for GPUs: the broadcast protocol of `collective.py` on a private
`ProcessGroupNCCL`, with buckets packed and received in device memory.

Untested here (no GPUs); the rendezvous, the protocol, the packing and the per-rank
delivery of sharded manifests (each TP rank receives only its own shard, point to point,
`sharded.py`) are the ones the gloo transport runs in CI; only the process group and the
device differ. The sender's buffers live on its GPU and are filled from the trainer's FSDP
shards device to device.

Ports: the store is the gloo one (bound to `host` only). NCCL itself opens a bootstrap listener
per rank and, for ranks on other hosts, its socket transport's connections, on ports the
kernel picks, on the interface ``NCCL_SOCKET_IFNAME`` names (default: the first non-loopback
one NCCL finds); set ``NCCL_SOCKET_IFNAME`` to pin it (lo for one host).
"""

from __future__ import annotations

import datetime
from typing import Any

from transport.collective import _Group
from transport.gloo import GlooCoSender, GlooReceiver, GlooSender


def _nccl_group(store: Any, rank: int, world_size: int, timeout_s: float, device: str) -> _Group:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(torch.device(device))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("jaxrl-weights", store), rank, world_size, opts)
    return _Group(pg, device, timeout_s)


class NcclSender(GlooSender):
    """Rank 0 on `device` (e.g. `"cuda:0"`): `GlooSender`'s rendezvous on a NCCL group.

    Args:
        host, port, num_receivers, timeout_s, port_count, senders: as `GlooSender`.
        device: the CUDA device the send buffers live on.
    """

    def __init__(
        self,
        host: str,
        port: int,
        num_receivers: int,
        timeout_s: float = 300.0,
        device: str = "cuda:0",
        port_count: int = 1,
        senders: int = 1,
    ) -> None:
        super().__init__(host, port, num_receivers, timeout_s, port_count, senders)
        self.device = device

    def _group_on(self, store: Any) -> _Group:
        return _nccl_group(store, 0, self.world_size, self.timeout_s, self.device)


class NcclReceiver(GlooReceiver):
    """Rank `rank` (>= 1) on `device`: `GlooReceiver`'s rendezvous on a NCCL group.

    Args:
        host, port, rank, world_size, timeout_s: as `GlooReceiver`.
        device: the CUDA device the receive buffers live on.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 300.0,
        device: str = "cuda:0",
    ) -> None:
        super().__init__(host, port, rank, world_size, timeout_s)
        self.device = device

    def _group_on(self, store: Any) -> _Group:
        return _nccl_group(store, self.rank, self.world_size, self.timeout_s, self.device)


class NcclCoSender(GlooCoSender):
    """Sender rank `rank` (>= 1) on `device`: `GlooCoSender` on a NCCL group.

    Args:
        host, port, rank, world_size, timeout_s: as `GlooCoSender`.
        device: the CUDA device the send buffers live on.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 300.0,
        device: str = "cuda:0",
    ) -> None:
        super().__init__(host, port, rank, world_size, timeout_s)
        self._peer = NcclReceiver(host, port, rank, world_size, timeout_s, device)
        self.device = device
