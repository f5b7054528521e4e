"""Weights over torch.distributed gloo (TCP), for CPUs: a standalone group of 1 + N ranks.

The sender (rank 0) hosts the rendezvous store at (host, port); port 0 picks a free one,
read back from `GlooSender.port` and handed to the receivers through the control plane.
The group is a private `ProcessGroupGloo` on its own `TCPStore`, so it coexists with any
default process group the engine already runs (vLLM's own workers have one).
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


def _gloo_group(store: Any, rank: int, world_size: int, timeout_s: float) -> _Group:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("jaxrl-weights", store), rank, world_size, timeout)
    return _Group(pg, "cpu", timeout_s)


class GlooSender(CollectiveSender):
    """Rank 0: binds the rendezvous store at once, joins the group on `connect`/`send`.

    Args:
        host: address the receivers connect to (and this side binds).
        port: TCP port of the store; 0 picks a free one (see `port`).
        num_receivers: number of receiving ranks N (world size N + 1).
        timeout_s: limit in seconds of the rendezvous and of every collective.
    """

    def __init__(self, host: str, port: int, num_receivers: int, timeout_s: float = 300.0) -> None:
        super().__init__()
        if num_receivers < 1:
            raise ValueError(f"num_receivers must be >= 1, got {num_receivers}")
        self.host = host
        self.world_size = num_receivers + 1
        self.timeout_s = timeout_s
        self._store: Any = rendezvous_store(host, port, self.world_size, timeout_s, master=True)

    @property
    def port(self) -> int:
        """The TCP port the store listens on."""
        return int(self._store.port)

    def _make_group(self) -> _Group:
        return _gloo_group(self._store, 0, self.world_size, self.timeout_s)

    def close(self) -> None:
        """Drop the group, the send buffers and the store."""
        super().close()
        self._store = None


class GlooReceiver(CollectiveReceiver):
    """Rank `rank` (>= 1) of the group hosted by a `GlooSender` at (host, port).

    Args:
        host, port: the sender's store.
        rank: this receiver's rank in 1..world_size-1.
        world_size: 1 + number of receivers.
        timeout_s: limit in seconds of the rendezvous and of every collective.
    """

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0
    ) -> None:
        super().__init__()
        if not 1 <= rank < world_size:
            raise ValueError(f"rank must be in 1..{world_size - 1}, got {rank}")
        self.host, self.port, self.rank = host, port, rank
        self.world_size, self.timeout_s = world_size, timeout_s

    def _make_group(self) -> _Group:
        store = rendezvous_store(
            self.host, self.port, self.world_size, self.timeout_s, master=False
        )
        return _gloo_group(store, self.rank, self.world_size, self.timeout_s)

    def close(self) -> None:
        """Drop the group."""
        self._group = None
