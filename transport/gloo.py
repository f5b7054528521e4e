"""Weights over torch.distributed gloo (TCP), for CPUs: a standalone group of 1 + N ranks.

The sender (rank 0) hosts the rendezvous store at (host, port), listening on `host` only;
port 0 picks a free one, a port range (`port_count`) takes its first free port; the port is
read back from `GlooSender.port` and handed to the receivers through the control plane.
The group is a private `ProcessGroupGloo` on its own `TCPStore`, so it coexists with any
default process group the engine already runs (vLLM's own workers have one).

Ports: besides the store, gloo opens one listening socket per rank on a port the kernel picks
(its ephemeral range), and the pairs between ranks connect to those. The sender's gloo device
is bound to `host`, each receiver's to its own address on the interface that routes to `host`
(`collective.local_address_towards`), so on 127.0.0.1 nothing of the group listens beyond the
loopback. ``GLOO_SOCKET_IFNAME`` overrides both (torch's default device).
"""

from __future__ import annotations

import datetime
from typing import Any

from transport.collective import (
    Abandon,
    CollectiveReceiver,
    CollectiveSender,
    _Group,
    announce_join,
    await_receivers,
    gloo_device,
    local_address_towards,
    rendezvous_store,
)


def _gloo_group(store: Any, rank: int, world_size: int, timeout_s: float, address: str) -> _Group:
    """A private gloo group whose device is bound to `address` (see `gloo_device`)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [gloo_device(address)]
    pg = dist.ProcessGroupGloo(dist.PrefixStore("jaxrl-weights", store), rank, world_size, opts)
    return _Group(pg, "cpu", timeout_s)


class GlooSender(CollectiveSender):
    """Rank 0: binds the rendezvous store at once, joins the group on `connect`/`send`.

    Args:
        host: address the receivers connect to (and the only one this side binds: the store
            and the gloo device).
        port: TCP port of the store; 0 picks a free one (see `port`).
        num_receivers: number of receiving ranks N (world size N + `senders`).
        timeout_s: limit in seconds of the rendezvous and of every collective.
        port_count: with `port` > 0, the store takes the first free port of
            `port .. port + port_count - 1`.
        senders: trainer processes that send together (`transport.fan_in`): this one is
            rank 0 and hosts the store, the others (`GlooCoSender`) join it as ranks
            1..senders-1 like receivers do.

    Raises:
        OSError: no port of the range is free (or `host` is not the local machine's).
    """

    def __init__(
        self,
        host: str,
        port: int,
        num_receivers: int,
        timeout_s: float = 300.0,
        port_count: int = 1,
        senders: int = 1,
    ) -> None:
        super().__init__()
        if num_receivers < 1 or senders < 1:
            raise ValueError(
                f"num_receivers, senders: expected >= 1, got {num_receivers}, {senders}"
            )
        self.host = host
        self.world_size = num_receivers + senders
        self.timeout_s = timeout_s
        self._store: Any = rendezvous_store(
            host, port, self.world_size, timeout_s, master=True, port_count=port_count
        )

    @property
    def port(self) -> int:
        """The TCP port the store listens on."""
        return int(self._store.port)

    def _make_group(self, abandon: Abandon | None) -> _Group:
        await_receivers(self._store, self.world_size, self.timeout_s, abandon)
        return self._group_on(self._store)

    def _group_on(self, store: Any) -> _Group:
        """Rank 0's process group on `store` (every receiver announced itself)."""
        return _gloo_group(store, 0, self.world_size, self.timeout_s, self.host)

    def close(self) -> None:
        """Drop the group, the send buffers and the store."""
        super().close()
        self._store = None


class GlooCoSender(CollectiveSender):
    """Sender rank `rank` (1..senders-1) of a group whose rank 0 (a `GlooSender` in trainer
    process 0) hosts the store at (host, port): another trainer process that sends its own
    blocks of a version (`transport.fan_in`). It joins as a receiver does (announces itself,
    then builds its process group), so rank 0's wait for the group covers it.

    Args:
        host, port: rank 0's store (the plan's transport config).
        rank: this sender's group rank (>= 1).
        world_size: senders + receiving ranks.
        timeout_s: limit in seconds of the rendezvous and of every collective.
    """

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0
    ) -> None:
        super().__init__()
        self._peer = GlooReceiver(host, port, rank, world_size, timeout_s)
        self.rank = rank

    def _make_group(self, abandon: Abandon | None) -> _Group:
        return self._peer._make_group()


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
        return self._group_on(self._joined_store())

    def _joined_store(self) -> Any:
        """The sender's store, this rank's join announced on it (`announce_join`)."""
        store = rendezvous_store(
            self.host, self.port, self.world_size, self.timeout_s, master=False
        )
        announce_join(store, self.rank)
        return store

    def _group_on(self, store: Any) -> _Group:
        """This rank's process group on the sender's `store`."""
        address = local_address_towards(self.host, self.port)
        return _gloo_group(store, self.rank, self.world_size, self.timeout_s, address)

    def close(self) -> None:
        """Drop the group and the receive buffers."""
        self._group = None
        self._recv = None
