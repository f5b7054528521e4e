"""The broadcast protocol shared by the collective transports (gloo on CPUs, NCCL on GPUs).

Rank 0 is the sender; ranks 1..N are receivers (an engine's tensor-parallel workers). Per
version: broadcast the manifest length `int64 [1]` and its JSON bytes `uint8 [L]`; all-reduce
(MIN) an accept flag `int32 [1]`; broadcast each packed bucket `uint8 [total_bytes]`;
all-reduce (MIN) a loaded flag `int32 [1]`: the commit. A receiver whose callback fails keeps
draining the remaining buckets so the group stays in step, then votes 0 at the commit.
A timeout or a broken connection leaves the group out of step: close both ends and reconnect.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gateway.transport.base import (
    OnBucket,
    SendStats,
    TransferError,
    WeightReceiver,
    WeightSender,
    iter_packed,
    unpack,
)
from gateway.transport.manifest import Manifest, ManifestError, bucket_layout

if TYPE_CHECKING:
    import torch


def rendezvous_store(
    host: str, port: int, world_size: int, timeout_s: float, *, master: bool
) -> Any:
    """The `torch.distributed.TCPStore` a transport group meets on: the sender (rank 0) hosts
    it (`master`, port 0 picks a free one), each receiver connects to it. Imports torch lazily.

    Raises:
        RuntimeError (from torch): the store cannot bind, or no master answers in `timeout_s`.
    """
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if master:
        return dist.TCPStore(
            host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


class _Group:
    """A thin wrapper over a torch c10d process group: broadcast from 0 and MIN all-reduce."""

    def __init__(self, pg: Any, device: str) -> None:
        self.pg = pg
        self.device = device

    def broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def all_min(self, flag: int) -> int:
        import torch
        import torch.distributed as dist

        t = torch.tensor([flag], dtype=torch.int32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self.pg.allreduce([t], opts).wait()
        return int(t.item())


class CollectiveSender(WeightSender):
    """Rank 0 of a broadcast group; subclasses build the process group in `_make_group`."""

    device = "cpu"

    def __init__(self) -> None:
        self._group: _Group | None = None

    def _make_group(self) -> _Group:
        raise NotImplementedError

    def connect(self) -> None:
        """Join the group (blocks until every receiver joined, or the timeout)."""
        if self._group is None:
            self._group = self._make_group()

    def send(self, manifest: Manifest, tensors: Iterable[tuple[str, Any]]) -> SendStats:
        """See `WeightSender.send`; the buckets are packed on `self.device`."""
        import torch

        self.connect()
        g = self._group
        assert g is not None
        t0 = time.perf_counter()
        header = manifest.to_json()
        try:
            g.broadcast(torch.tensor([len(header)], dtype=torch.int64, device=g.device))
            g.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(g.device))
            if g.all_min(1) != 1:
                raise TransferError(
                    f"a receiver refused the manifest of version {manifest.version}"
                )
            n = 0
            for buf in iter_packed(manifest, tensors, device=g.device):
                g.broadcast(buf)
                n += 1
            if g.all_min(1) != 1:
                raise TransferError(f"a receiver failed to load version {manifest.version}")
        except RuntimeError as e:
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"sending version {manifest.version} failed: {e}") from e
        return SendStats(manifest.version, manifest.total_bytes, n, time.perf_counter() - t0)


class CollectiveReceiver(WeightReceiver):
    """Rank >= 1 of a broadcast group; subclasses build the process group in `_make_group`."""

    device = "cpu"

    def __init__(self) -> None:
        self._group: _Group | None = None

    def _make_group(self) -> _Group:
        raise NotImplementedError

    def connect(self) -> None:
        """Join the group (blocks until the sender and every receiver joined, or the timeout)."""
        if self._group is None:
            self._group = self._make_group()

    def _offered(self) -> bytes:
        import torch

        g = self._group
        assert g is not None
        n = torch.zeros(1, dtype=torch.int64, device=g.device)
        g.broadcast(n)
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=g.device)
        g.broadcast(data)
        return bytes(data.cpu().numpy().tobytes())

    def refuse(self, reason: str) -> None:
        """Take the offered manifest and vote no, so the sender fails fast.

        Raises:
            TransferError: always, with `reason`, once the sender has been told.
        """
        self.connect()
        try:
            self._offered()
            assert self._group is not None
            self._group.all_min(0)
        except RuntimeError as e:
            raise TransferError(f"refusing failed: {e}; refusal reason: {reason}") from e
        raise TransferError(f"refused: {reason}")

    def receive(self, manifest: Manifest, on_bucket: OnBucket) -> None:
        """See `WeightReceiver.receive`."""
        import torch

        self.connect()
        g = self._group
        assert g is not None
        try:
            offered = self._offered()
            if offered != manifest.to_json():
                g.all_min(0)
                got = Manifest.from_json(offered)
                raise ManifestError(
                    f"offered manifest (version {got.version}, {len(got.tensors)} tensors, "
                    f"bucket {got.bucket_bytes} B) differs from the expected one (version "
                    f"{manifest.version}, {len(manifest.tensors)} tensors, bucket "
                    f"{manifest.bucket_bytes} B)"
                )
            if g.all_min(1) != 1:
                raise TransferError(f"another receiver refused version {manifest.version}")
            failure: BaseException | None = None
            for bucket in manifest.buckets():
                _, total = bucket_layout(manifest, bucket)
                buf = torch.empty(total, dtype=torch.uint8, device=g.device)
                g.broadcast(buf)
                if failure is None:
                    try:
                        on_bucket(unpack(manifest, bucket, buf))
                    except Exception as e:  # keep draining so the group stays in step
                        failure = e
            ok = g.all_min(0 if failure is not None else 1)
        except RuntimeError as e:
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"receiving version {manifest.version} failed: {e}") from e
        if failure is not None:
            raise TransferError(
                f"loading version {manifest.version} failed: {failure!r}"
            ) from failure
        if ok != 1:
            raise TransferError(f"another receiver failed to load version {manifest.version}")
