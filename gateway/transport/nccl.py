"""Weights over NCCL, for GPUs: the broadcast protocol of `collective.py` on a private
`ProcessGroupNCCL`, with buckets packed and received in device memory.

Untested here (no GPUs); the rendezvous, the protocol, the packing and the per-rank
delivery of sharded manifests (each TP rank receives only its own shard, point to point,
`sharded.py`) are the ones the gloo transport runs in CI; only the process group and the
device differ. The sender's buffers live on its GPU and are filled from the trainer's FSDP
shards device to device.
"""

from __future__ import annotations

import datetime
from typing import Any

from gateway.transport.collective import (
    CollectiveReceiver,
    CollectiveSender,
    _Group,
    rendezvous_store,
)


def _nccl_group(store: Any, rank: int, world_size: int, timeout_s: float, device: str) -> _Group:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(torch.device(device))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("jaxrl-weights", store), rank, world_size, opts)
    return _Group(pg, device, timeout_s)


class NcclSender(CollectiveSender):
    """Rank 0 on `device` (e.g. `"cuda:0"`); arguments as `GlooSender`."""

    def __init__(
        self,
        host: str,
        port: int,
        num_receivers: int,
        timeout_s: float = 300.0,
        device: str = "cuda:0",
    ) -> None:
        super().__init__()
        self.device = device
        self.world_size = num_receivers + 1
        self.timeout_s = timeout_s
        self._store: Any = rendezvous_store(host, port, self.world_size, timeout_s, master=True)

    @property
    def port(self) -> int:
        """The TCP port the rendezvous store listens on."""
        return int(self._store.port)

    def _make_group(self) -> _Group:
        return _nccl_group(self._store, 0, self.world_size, self.timeout_s, self.device)


class NcclReceiver(CollectiveReceiver):
    """Rank `rank` (>= 1) on `device`; arguments as `GlooReceiver`."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 300.0,
        device: str = "cuda:0",
    ) -> None:
        super().__init__()
        if not 1 <= rank < world_size:
            raise ValueError(f"rank must be in 1..{world_size - 1}, got {rank}")
        self.host, self.port, self.rank, self.device = host, port, rank, device
        self.world_size, self.timeout_s = world_size, timeout_s

    def _make_group(self) -> _Group:
        store = rendezvous_store(
            self.host, self.port, self.world_size, self.timeout_s, master=False
        )
        return _nccl_group(store, self.rank, self.world_size, self.timeout_s, self.device)
