"""The broadcast protocol shared by the collective transports (gloo on CPUs, NCCL on GPUs).

Rank 0 is the sender; ranks 1..N are receivers (the engines' tensor-parallel workers; group
rank g is TP rank `reshard.tp_rank_of(g, tp_size)`). Per version: broadcast the manifest's
fingerprint `uint8 [72]` (`Manifest.fingerprint`: the manifest itself came with the sync plan,
and each receiver compares the fingerprint with its own); all-reduce (MIN) an accept flag
`int32 [1]`; then per bucket either
- (a manifest with `tp_size` 1) broadcast the packed bucket `uint8 [total_bytes]`, or
- (a sharded manifest, `sharded.py`) broadcast the bucket's replicated tensors, if any, and
  send each receiver only its TP rank's regions of the sharded ones, point to point, or
- (a manifest of several senders, `Manifest.senders` P > 1: trainer processes 0..P-1 are
  ranks 0..P-1, the receivers follow) each sender sends each receiver the parts of its own
  blocks that the receiver's region needs, point to point (`fan_in.py`): fan-in;
then all-reduce (MIN) a loaded flag `int32 [1]`: the commit. A receiver whose callback fails keeps
draining the remaining buckets so the group stays in step, then votes 0 at the commit.

The buckets are pipelined (`PIPELINE_DEPTH` = 2): the sender starts bucket k's collectives
without waiting and packs bucket k+1 meanwhile, into the other of two reused buffers; a
receiver posts bucket k+1's receive before it loads bucket k, so the wire runs beside the
trainer's packing and the engine's load. The receiver's buffers are reused across buckets and
versions too (`recv_buffers`: never one a loader still holds views of). Both sides issue the
same collectives in the same order (gloo matches broadcasts by their sequence, point-to-point
messages in the order they were sent), and each side waits for every one before the commit.
Where packing, the wire and the engine's load use different resources (a GPU's copy engines
and NIC) this hides all but the slowest; on a CPU host where every stage needs the same cores
the push does not get faster (`benchmarks/weight_sync.py`), vLLM's own load (its layerwise
reload and oneDNN repacking) being most of it.
A timeout or a broken connection leaves the group out of step: close both ends and reconnect.
Either end releases its process group the moment a collective fails (`_release`): gloo closes
a group's connections only when the group is destroyed (`abort` and `shutdown` leave them
open), and a rank that failed but kept its group would hold every other rank in its
collective until the timeout (the sender blocked writing to it, the receivers waiting on the
sender). The `TransferError` raised then carries the failure as text only (no chained
exception or traceback frame keeps the group alive).

Forming a group: each receiver announces itself on the store (`announce_join`) before it
builds its process group, and the sender builds its own only once every receiver did
(`await_receivers`), checking between polls whether to give up (`Abandon`: e.g. the control
plane dropped a member that died before it joined). A process-group constructor waits for every
rank with no way out but its timeout, so this keeps a dead member from holding the sender
there for `timeout_s`; a failure of the constructor itself is a `TransferError` too.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transport import fan_in
from transport.base import (
    BufferPool,
    OnBucket,
    SendStats,
    TransferError,
    WeightReceiver,
    WeightSender,
    iter_packed,
    slot_key,
    unpack,
)
from transport.manifest import FINGERPRINT_BYTES, Manifest, ManifestError, bucket_layout
from transport.recv_buffers import ReceiveBuffers
from transport.reshard import tp_rank_of
from transport.sharded import iter_packed_sharded, rank_layout, split_bucket, unpack_rank

if TYPE_CHECKING:
    import torch


def _release(owner: Any) -> None:
    """Destroy `owner._group`'s process group now, closing its connections (see the module
    docstring): drop the reference and collect the cycles a failure's traceback left."""
    import gc

    owner._group = None
    gc.collect()


def _form(owner: Any, make: Callable[[], Any]) -> None:
    """Set `owner._group = make()`; a failure to form is a `TransferError` carrying it as
    text (see `_release`)."""
    try:
        owner._group = make()
        return
    except TransferError:
        raise
    except RuntimeError as e:  # torch's DistStoreError / DistNetworkError
        failure = f"forming the group failed: {e}"
    _release(owner)
    raise TransferError(failure)


def bind_listener(host: str, port: int, port_count: int = 1) -> socket.socket:
    """A listening TCP socket bound to `host` only (never every interface unless `host` is
    "0.0.0.0" or "::"), on the first free port of `port .. port + port_count - 1`; port 0
    lets the kernel pick one.

    Raises:
        ValueError: a port range outside 1..65535, or `port_count` < 1.
        OSError: `host` does not resolve, or every port of the range is taken.
    """
    if port_count < 1 or not 0 <= port <= 65535 or (port and port + port_count - 1 > 65535):
        raise ValueError(f"ports: expected 0, or port..port+port_count-1 in 1..65535; got "
                         f"port {port}, port_count {port_count}")  # fmt: skip
    candidates = [0] if port == 0 else list(range(port, port + port_count))
    last: OSError | None = None
    for p in candidates:
        for family, kind, proto, _, addr in socket.getaddrinfo(host, p, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
                sock.listen(128)
                return sock
            except OSError as e:
                sock.close()
                last = e
    raise OSError(f"no free port to listen on at {host} in {candidates[0]}.."
                  f"{candidates[-1]}: {last}")  # fmt: skip


def rendezvous_store(
    host: str, port: int, world_size: int, timeout_s: float, *, master: bool, port_count: int = 1
) -> Any:
    """The `torch.distributed.TCPStore` a transport group meets on: the sender (rank 0) hosts
    it (`master`), each receiver connects to it. Imports torch lazily.

    The master's listening socket is bound here (`bind_listener`: `host` only, the first free
    port of `port .. port + port_count - 1`, port 0 picks one) and handed to the store, which
    would otherwise listen on every interface whatever `host` says.

    A receiver connects with `STORE_CONNECT_S` as its limit, then waits up to `timeout_s` for
    keys: the master exists before any plan names it, so a store nobody answers at is a group
    the sender already dropped (a late joiner of a broken attempt). torch retries a refused
    connection for about 2.5 times its timeout, so with `timeout_s` as the connect limit (300 s)
    such an engine was held in the connect for over ten minutes, deaf to the re-planned push
    (seen in CI: the re-plan's wait for "ready" ran out on it).

    Raises:
        OSError: no port of the range is free. RuntimeError (from torch): no master answers
            within about 2.5 x `STORE_CONNECT_S` seconds.
    """
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if master:
        sock = bind_listener(host, port, port_count)
        bound = int(sock.getsockname()[1])
        return dist.TCPStore(
            host, bound, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
            master_listen_fd=sock.detach(), use_libuv=True,
        )  # fmt: skip
    connect = datetime.timedelta(seconds=min(timeout_s, STORE_CONNECT_S))
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=connect)
    store.set_timeout(timeout)
    return store


STORE_CONNECT_S = 5.0
"""Seconds a receiver's store client tries to reach the sender's store (torch retries within
about 2.5 times this): the store is up before its plan is published, so only a dropped group
is unreachable."""


PIPELINE_DEPTH = 2
"""Buckets a collective sender keeps in flight (and a receiver posts ahead): with 2, bucket k+1
is packed on the sender, and bucket k-1 loaded on the receiver, while bucket k is on the
wire. Each side holds up to this many buckets."""

Abandon = Callable[[], "str | None"]
"""Asked between polls while a group forms: a reason to give up (e.g. "engines [...] left"), or
None to keep waiting."""

JOIN_POLL_S = 0.05
"""Seconds between the sender's looks at the store while the receivers join."""

ABANDON_POLL_S = 0.5
"""Seconds between two calls of the `Abandon` check while the receivers join."""


def joined_key(rank: int) -> str:
    """The store key receiver `rank` sets once it is about to build its process group."""
    return f"jaxrl-joined/{rank}"


def announce_join(store: Any, rank: int) -> None:
    """Receiver side: tell the sender (through the group's store) that `rank` is joining."""
    store.set(joined_key(rank), "1")


def await_receivers(
    store: Any, world_size: int, timeout_s: float, abandon: Abandon | None = None
) -> None:
    """Sender side: return once every receiver 1..world_size-1 announced its join.

    Looks at the store every `JOIN_POLL_S` seconds and calls `abandon` (when given) every
    `ABANDON_POLL_S` seconds.

    Raises:
        TransferError: `abandon` gave a reason, or `timeout_s` seconds passed; the message
            names the ranks that never announced themselves. Its traceback holds no
            reference to `store`: once the caller drops its own, the store's server closes
            and the receivers that joined fail at once.
    """
    keys = [joined_key(r) for r in range(1, world_size)]
    t0 = time.monotonic()
    next_check = t0
    while not store.check(keys):
        now = time.monotonic()
        reason = None
        if abandon is not None and now >= next_check:
            reason = abandon()
            next_check = now + ABANDON_POLL_S
        if reason or now - t0 > timeout_s:
            missing = [r for r, k in enumerate(keys, 1) if not store.check([k])]
            why = reason or f"no word from them in {timeout_s:g} s"
            del store  # the error's traceback must not keep the store (and its server) alive
            raise TransferError(
                f"the group of {world_size} ranks did not form: ranks {missing} never "
                f"joined ({why})"
            )
        time.sleep(JOIN_POLL_S)


def local_address_towards(host: str, port: int) -> str:
    """The local machine's address on the interface that routes to (host, port): where a receiver
    binds its gloo device so the sender can reach it (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port or 9))
        return str(probe.getsockname()[0])


def gloo_device(address: str) -> Any:
    """The gloo device of a group: bound to `address` (its listening socket and its pairs stay
    on that interface), or, when ``GLOO_SOCKET_IFNAME`` is set or `address` is every interface
    ("", "0.0.0.0", "::"), torch's default device (which honours that variable)."""
    import os

    import torch.distributed as dist

    if os.environ.get("GLOO_SOCKET_IFNAME") or address in ("", "0.0.0.0", "::"):
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=address)


class _Group:
    """A thin wrapper over a torch c10d process group: broadcast from 0, MIN all-reduce, and
    point-to-point sends from 0, each bounded by `timeout_s` seconds. The `*_start` forms
    return the collective's work handles without waiting (`wait` takes them), so the caller
    can pack or load one bucket while the next is on the wire."""

    def __init__(self, pg: Any, device: str, timeout_s: float = 300.0) -> None:
        self.pg = pg
        self.device = device
        self.timeout_s = timeout_s
        self.wait_s = 0.0  # seconds spent in `wait` so far (phase timing of a send/receive)

    def broadcast_start(self, t: torch.Tensor) -> list[Any]:
        """Start broadcasting `t` from rank 0 (every rank calls it, in the same order)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return [self.pg.broadcast([t], opts)]

    def send_each_start(self, bufs: dict[int, torch.Tensor]) -> list[Any]:
        """Start sending `bufs[g]` to group rank g, every send in flight at once (rank 0)."""
        return [self.pg.send([t], g, 0) for g, t in bufs.items()]

    def recv_start(self, t: torch.Tensor, src: int = 0) -> list[Any]:
        """Start receiving into `t` from rank `src` (matched in the order the sends were
        made)."""
        return [self.pg.recv([t], src, 0)]

    def wait(self, works: list[Any]) -> None:
        """Wait for every work of `works`, each within `timeout_s`.

        Raises:
            RuntimeError: (from torch) a collective failed or timed out.
        """
        import datetime

        t0 = time.monotonic()
        for w in works:
            w.wait(datetime.timedelta(seconds=self.timeout_s))
        self.wait_s += time.monotonic() - t0

    def broadcast(self, t: torch.Tensor) -> None:
        self.wait(self.broadcast_start(t))

    def all_min(self, flag: int) -> int:
        import torch
        import torch.distributed as dist

        t = torch.tensor([flag], dtype=torch.int32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self.pg.allreduce([t], opts).wait()
        return int(t.item())


class CollectiveSender(WeightSender):
    """A sender of a broadcast group: rank 0 (which drives the group), or with a manifest of
    several senders (`Manifest.senders`, `transport.fan_in`) any rank below that count;
    subclasses build the process group in `_make_group`.

    Packs every bucket into buffers it keeps between pushes (`base.BufferPool`: about one
    bucket of memory on the group's device; `close` frees them).
    """

    device = "cpu"
    rank = 0

    def __init__(self) -> None:
        self._group: _Group | None = None
        self._pool: BufferPool | None = None

    def _buffers(self) -> BufferPool:
        g = self._group
        assert g is not None
        if self._pool is None or self._pool.device != g.device:
            self._pool = BufferPool(g.device)
        return self._pool

    def close(self) -> None:
        """Drop the group and the send buffers."""
        self._group = None
        self._pool = None

    def _make_group(self, abandon: Abandon | None) -> _Group:
        raise NotImplementedError

    def connect(self, abandon: Abandon | None = None) -> None:
        """Join the group: blocks until every receiver joined (see "Forming a group").

        Args:
            abandon: asked every `ABANDON_POLL_S` seconds until the receivers joined; a
                reason it gives ends the wait.

        Raises:
            TransferError: `abandon` gave a reason, the receivers did not all join within the
                timeout, or the process group failed to form.
        """
        if self._group is None:
            _form(self, lambda: self._make_group(abandon))

    def send(self, manifest: Manifest, tensors: Iterable[tuple[str, Any]]) -> SendStats:
        """See `WeightSender.send`; the buckets are packed on `self.device`. With a manifest
        of several senders each item is (name, this sender's blocks of the tensor: a list of
        arrays shaped as `fan_in.boxes_of`, possibly empty), and the stats count the bytes
        this sender sent."""
        import torch

        self.connect()
        g = self._group
        assert g is not None
        t0 = time.perf_counter()
        header = manifest.fingerprint()
        try:
            g.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(g.device))
            if g.all_min(1) != 1:
                raise TransferError(
                    f"a receiver refused the manifest of version {manifest.version}"
                )
            t1, waited = time.perf_counter(), g.wait_s
            if manifest.senders > 1:
                n, num_bytes = self._stream_fan_in(manifest, tensors)
            else:
                n, num_bytes = self._stream(manifest, tensors), manifest.total_bytes
            t2, wire = time.perf_counter(), g.wait_s - waited
            if g.all_min(1) != 1:
                raise TransferError(f"a receiver failed to load version {manifest.version}")
        except TransferError:
            raise
        except RuntimeError as e:
            failure = f"sending version {manifest.version} failed: {e}"
            kind: type[Exception] = TransferError
        except ManifestError as e:  # tensors that do not fit: the peers must not wait
            failure, kind = str(e), ManifestError
        else:
            t3 = time.perf_counter()
            phases = {"offer_s": t1 - t0, "pack_s": t2 - t1 - wire, "wire_s": wire}
            phases["commit_s"] = t3 - t2
            return SendStats(manifest.version, num_bytes, n, t3 - t0, phases=phases)
        g = None  # noqa: F841 - this frame's reference goes with the group's
        _release(self)
        raise kind(failure)

    def _stream(self, manifest: Manifest, tensors: Iterable[tuple[str, Any]]) -> int:
        """Send every bucket, `PIPELINE_DEPTH` at once: bucket k+1 is packed while bucket k
        is on the wire. Per bucket, one broadcast of the packed bucket, or (sharded) one of
        its replicated part and a send of each rank's regions. Returns the bucket count."""
        g = self._group
        assert g is not None
        inflight: deque[list[Any]] = deque()
        n = 0
        if manifest.sharded:
            world = int(g.pg.size())
            tp_of = {r: tp_rank_of(r, manifest.tp_size) for r in range(1, world)}
            packing = iter_packed_sharded(
                manifest, tensors, tp_of.values(), g.device, self._buffers(), PIPELINE_DEPTH
            )
            for packed in packing:
                works = []
                if packed.replicated is not None:
                    works += g.broadcast_start(packed.replicated)
                if packed.per_rank:
                    works += g.send_each_start({r: packed.per_rank[tp] for r, tp in tp_of.items()})
                n += _keep_in_flight(g, inflight, works)
        else:
            packed_buckets = iter_packed(
                manifest, tensors, g.device, self._buffers(), PIPELINE_DEPTH
            )
            for buf in packed_buckets:
                n += _keep_in_flight(g, inflight, g.broadcast_start(buf))
        while inflight:
            g.wait(inflight.popleft())
        return n

    def _stream_fan_in(
        self, manifest: Manifest, tensors: Iterable[tuple[str, Any]]
    ) -> tuple[int, int]:
        """Send this sender's messages of every bucket (`transport.fan_in`), `PIPELINE_DEPTH`
        buckets in flight; one message per receiving TP rank is packed and sent to every
        receiver of that rank. Returns (bucket count, payload bytes sent: every receiver's
        parts, without the alignment padding).

        Raises:
            ManifestError: a name that differs from the manifest, a missing block, or too few
                or too many tensors.
        """
        g = self._group
        assert g is not None
        world, first = int(g.pg.size()), manifest.senders
        tp_of = {r: tp_rank_of(r, manifest.tp_size, first) for r in range(first, world)}
        pool, it = self._buffers(), iter(tensors)
        inflight: deque[list[Any]] = deque()
        n = sent = 0
        for k, bucket in enumerate(manifest.buckets()):
            blocks = {}
            for i in bucket:
                name, mine = next(it, (None, ()))
                if name != manifest.tensors[i].name:
                    raise ManifestError(
                        f"tensor {i}: got {name!r}, manifest says {manifest.tensors[i].name!r}"
                    )
                blocks[i] = list(mine)
            bufs, payload = {}, {}
            for tp in sorted(set(tp_of.values())):
                parts, total = fan_in.message_layout(manifest, bucket, self.rank, tp)
                if total:
                    bufs[tp] = pool.get(slot_key(f"fan{tp}", k, PIPELINE_DEPTH), total)
                    fan_in.pack(manifest, parts, blocks, bufs[tp])
                    payload[tp] = sum(p.nbytes for p in parts)
            to_send = {r: bufs[tp] for r, tp in tp_of.items() if tp in bufs}
            sent += sum(payload[tp] for tp in tp_of.values() if tp in payload)
            n += _keep_in_flight(g, inflight, g.send_each_start(to_send))
        extra = next(it, None)
        if extra is not None:
            raise ManifestError(f"more tensors than the manifest lists, starting with {extra[0]!r}")
        while inflight:
            g.wait(inflight.popleft())
        return n, sent


def _keep_in_flight(g: _Group, inflight: deque[list[Any]], works: list[Any]) -> int:
    """Queue one bucket's `works`, then wait for the oldest until fewer than
    `PIPELINE_DEPTH` buckets are in flight (so the packer may reuse the oldest slot's
    buffers). Returns 1 (one more bucket sent)."""
    inflight.append(works)
    while len(inflight) >= PIPELINE_DEPTH:
        g.wait(inflight.popleft())
    return 1


class CollectiveReceiver(WeightReceiver):
    """Rank >= 1 of a broadcast group; subclasses build the process group in `_make_group`.

    After each `receive`, `phases` holds its seconds by phase: "wait_s" (waiting for the
    buckets' bytes), "copy_s" (unpacking them), "load_s" (the `on_bucket` callback) and
    "commit_s" (the commit vote).
    """

    device = "cpu"

    def __init__(self) -> None:
        self._group: _Group | None = None
        self.phases: dict[str, float] = {}
        self._recv: ReceiveBuffers | None = None

    def _buffers(self) -> ReceiveBuffers:
        """The receive buffers on the group's device, kept across buckets and versions
        (`transport.recv_buffers`: a buffer a loader still holds is never reused)."""
        g = self._group
        assert g is not None
        if self._recv is None or self._recv.device != g.device:
            self._recv = ReceiveBuffers(g.device)
        return self._recv

    def _make_group(self) -> _Group:
        raise NotImplementedError

    def connect(self) -> None:
        """Join the group (blocks until the sender and every receiver joined, or the timeout).

        Raises:
            TransferError: the group did not form (the timeout, or the sender closed its store:
                it gave up on a member that never joined).
        """
        if self._group is None:
            _form(self, self._make_group)

    def _offered(self) -> bytes:
        """The fingerprint of the manifest the sender offers (`Manifest.fingerprint`)."""
        import torch

        g = self._group
        assert g is not None
        data = torch.empty(FINGERPRINT_BYTES, dtype=torch.uint8, device=g.device)
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
            failure = f"refusing failed: {e}; refusal reason: {reason}"
        else:
            raise TransferError(f"refused: {reason}")
        _release(self)
        raise TransferError(failure)

    def receive(self, manifest: Manifest, on_bucket: OnBucket) -> None:
        """See `WeightReceiver.receive`."""

        self.connect()
        g = self._group
        assert g is not None
        try:
            offered = self._offered()
            try:
                manifest.check_offered(offered)
            except ManifestError:
                g.all_min(0)
                raise
            if g.all_min(1) != 1:
                raise TransferError(f"another receiver refused version {manifest.version}")
            failure: BaseException | None = None
            pending: _Posted | None = None
            self.phases = {"wait_s": 0.0, "copy_s": 0.0, "load_s": 0.0}
            for k, bucket in enumerate(manifest.buckets()):
                posted = self._post_bucket(manifest, bucket, k)  # on the wire while k-1 loads
                if pending is not None:
                    failure = self._land(pending, on_bucket, failure)
                pending = posted
            if pending is not None:
                failure = self._land(pending, on_bucket, failure)
            t0 = time.perf_counter()
            ok = g.all_min(0 if failure is not None else 1)
            self.phases["commit_s"] = time.perf_counter() - t0
        except TransferError:
            raise
        except RuntimeError as e:
            broken = f"receiving version {manifest.version} failed: {e}"
        else:
            broken = ""
        if broken:
            g = None  # noqa: F841 - this frame's reference goes with the group's
            _release(self)
            raise TransferError(broken)
        if failure is not None:
            raise TransferError(
                f"loading version {manifest.version} failed: {failure!r}"
            ) from failure
        if ok != 1:
            raise TransferError(f"another receiver failed to load version {manifest.version}")

    @property
    def group_rank(self) -> int:
        """This receiver's rank in the group (>= 1); subclasses set `rank`."""
        return int(getattr(self, "rank", 1))

    def _tp_rank(self, manifest: Manifest) -> int:
        """This receiver's engine TP rank: the group ranks after the senders, in order."""
        return tp_rank_of(self.group_rank, manifest.tp_size, manifest.senders)

    def _post_bucket(self, manifest: Manifest, bucket: list[int], k: int = 0) -> _Posted:
        """Start receiving bucket `k`: the whole bucket, or (sharded) the replicated part and
        this rank's regions, into the receive buffers of slot k mod `PIPELINE_DEPTH`
        (`_buffers`: reused across buckets and versions unless a loader still holds them)."""
        g = self._group
        assert g is not None
        if manifest.senders > 1:
            return self._post_fan_in(manifest, bucket)
        pool = self._buffers()
        if not manifest.sharded:
            _, total = bucket_layout(manifest, bucket)
            buf = pool.get(slot_key("bucket", k, PIPELINE_DEPTH), total)
            return _Posted(g.broadcast_start(buf), lambda: unpack(manifest, bucket, buf))
        tp_rank = self._tp_rank(manifest)
        split = split_bucket(manifest, bucket)
        works: list[Any] = []
        rep = mine = None
        if split.replicated:
            total = rank_layout(manifest, split.replicated, 0)[1]
            rep = pool.get(slot_key("replicated", k, PIPELINE_DEPTH), total)
            works += g.broadcast_start(rep)
        if split.sharded:
            total = rank_layout(manifest, split.sharded, tp_rank)[1]
            mine = pool.get(slot_key("mine", k, PIPELINE_DEPTH), total)
            works += g.recv_start(mine)
        return _Posted(works, lambda: unpack_rank(manifest, bucket, tp_rank, rep, mine))

    def _post_fan_in(self, manifest: Manifest, bucket: list[int]) -> _Posted:
        """Start receiving one bucket from each sender that has a part of it for this rank
        (`transport.fan_in`); its views come once the parts are copied into place."""
        import torch

        g = self._group
        assert g is not None
        tp_rank = self._tp_rank(manifest)
        layout, total = fan_in.receiver_layout(manifest, bucket, tp_rank)
        out = torch.empty(total, dtype=torch.uint8, device=g.device)
        works: list[Any] = []
        messages = []
        for sender in range(manifest.senders):
            parts, size = fan_in.message_layout(manifest, bucket, sender, tp_rank)
            if size:
                buf = torch.empty(size, dtype=torch.uint8, device=g.device)
                works += g.recv_start(buf, sender)
                messages.append((parts, buf))

        def views() -> Any:
            for parts, buf in messages:
                fan_in.scatter(manifest, parts, buf, out, layout)
            return fan_in.bucket_views(manifest, bucket, out, layout)

        return _Posted(works, views)

    def _land(
        self, posted: _Posted, on_bucket: OnBucket, failure: BaseException | None
    ) -> BaseException | None:
        """Wait for a posted bucket and hand it to `on_bucket`, unless a bucket before it
        failed to load (then only drain it). Returns the first load failure so far. Adds its
        seconds to `phases`: "wait_s" (the wait for its bytes), "copy_s" (its views: the
        unpacking, a copy where a sharded or fan-in bucket is scattered into place) and
        "load_s" (`on_bucket`)."""
        g = self._group
        assert g is not None
        t0 = time.perf_counter()
        g.wait(posted.works)
        t1 = time.perf_counter()
        self.phases["wait_s"] += t1 - t0
        if failure is not None:
            return failure
        t2 = t1
        try:
            views = posted.views()
            t2 = time.perf_counter()
            on_bucket(views)
        except Exception as e:  # keep draining so the group stays in step
            return e
        finally:
            t3 = time.perf_counter()
            self.phases["copy_s"] += (t2 if t2 > t1 else t3) - t1
            self.phases["load_s"] += t3 - t2 if t2 > t1 else 0.0
        return None


@dataclass
class _Posted:
    """A bucket whose receive has started: its work handles, and the views of its tensors
    once they are waited on."""

    works: list[Any]
    views: Callable[[], Any]
