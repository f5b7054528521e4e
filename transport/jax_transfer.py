"""The JAX-native data plane: trainer processes serve their blocks of a version through
`jax.experimental.transfer`, and a JAX engine pulls them onto its own device.

Every trainer process runs one transfer server (`server_for`: `start_transfer_server` on its
local devices' client, at one address for the whole run; `launch.data_plane=jax_transfer`
gathers every process's address into the transport settings, `servers`, so sender s is
`servers[s]`). A version's manifest names, per tensor, the blocks that tile it and which
sender holds each (`Manifest.sources`, as in `transport.fan_in`; with no `sources`, sender 0
holds every tensor whole). For each receiving engine (group rank r of the plan) sender s
schedules one pull (`TransferServer.await_pull`) of

    [the manifest's fingerprint as uint8 [72], then its blocks in manifest then source order]

under the id `pull_id(version, group, r)`, each block a single-device array in the wire dtype
(the trainer's own shard: no gather, no host copy where the platform allows; the transfer
library moves it device to device over ICI/DCN on TPU, between GPUs, or over TCP on CPU).
The engine connects to every sender, pulls the same list by the same id into its own device
(`JaxTransferReceiver.pull`), checks the fingerprint against the manifest it was told to
expect (another version or layout is refused before anything is used), and writes the blocks
into place on that device. The version commits through the control plane as for the file and
shm data planes: each engine acks "loaded" to the gateway, and the trainer's push waits for
those acks; a refused manifest, a pull that does not arrive within `timeout_s` or a sender
that died raise `TransferError` and the engine keeps serving its version.

A scheduled pull that no engine takes (the engine died or refused) is dropped by the server
after `timeout_s` (the arrays it held are freed then). One pull per id: a re-plan of the same
version is a new group generation, so new ids.

Measured on this CPU (jax 0.10.2): a pull into a device of a list whose arrays sit on the
sender's devices works; pulling one array sharded over two devices into one device fails
("Async transfer object was deleted before transfers completed"), hence the single-device
blocks; a pull whose id is never scheduled does not honour its own timeout, so readiness is
polled here against a deadline.

JAX is imported lazily, so the factory stays light for torch-only engines.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterable
from typing import Any

from transport.base import OnBucket, SendStats, TransferError, WeightReceiver, WeightSender
from transport.fan_in import boxes_of, sources_of
from transport.manifest import DTYPE_BYTES, FINGERPRINT_BYTES, Manifest, ManifestError

_SERVERS: dict[str, Any] = {}
_SERVERS_LOCK = threading.Lock()

#: Most group ranks an id can name (16 bits), and most group generations before ids wrap.
MAX_RANK = 1 << 16


def server_for(host: str) -> Any:
    """This process's transfer server bound to `host` (started on first use, then the same
    one: its address is what the other side was told). Its address is `host:port`.

    Raises:
        TransferError: the server could not start (e.g. `host` is not an address here).
    """
    import jax
    from jax.experimental import transfer

    with _SERVERS_LOCK:
        server = _SERVERS.get(host)
        if server is None:
            client = jax.local_devices()[0].client
            try:
                server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
            except Exception as e:  # noqa: BLE001 - the library raises its own runtime errors
                raise TransferError(f"jax_transfer: no transfer server at {host}: {e}") from e
            _SERVERS[host] = server
        return server


def address_of(host: str) -> str:
    """The address other processes connect to for this process's server (`server_for`)."""
    return str(server_for(host).address())


def pull_id(version: int, group: int, rank: int) -> int:
    """The pull id of `version` for the receiver at group `rank` of group generation `group`:
    `version << 32 | (group mod 2**16) << 16 | rank` (an int64; one pull per id).

    Raises:
        ManifestError: a negative version, or a rank outside 0..2**16 - 1.
    """
    if version < 0 or not 0 <= rank < MAX_RANK:
        raise ManifestError(f"pull id: version {version}, rank {rank} out of range")
    return (int(version) << 32) | ((int(group) % MAX_RANK) << 16) | int(rank)


def _deadline(seconds: float) -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=seconds)


def _wire(x: Any, dtype: str, device: Any) -> Any:
    """`x` as a single-device JAX array in the wire dtype: a JAX array on one device stays
    there (cast there); a numpy array or an array over several devices is placed on `device`."""
    import jax
    import jax.numpy as jnp

    want = jnp.dtype(dtype)
    if not (isinstance(x, jax.Array) and len(x.sharding.device_set) == 1):
        x = jax.device_put(x if isinstance(x, jax.Array) else jnp.asarray(x), device)
    return x if x.dtype == want else x.astype(want)


class JaxTransferSender(WeightSender):
    """Trainer process `rank`'s side: serves its blocks of each version to the plan's
    receivers (see the module docstring).

    Args:
        host: the address this process's server binds to and is reached at.
        timeout_s: seconds a scheduled pull waits for its engine before it is dropped.
        rank: this sender's index (`Manifest.sources` sender).
        receivers: the group ranks that pull each version (set per plan by `serve`).
        group: the plan's group generation (part of every pull id).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
        rank: int = 0,
        receivers: tuple[int, ...] = (),
        group: int = 0,
    ) -> None:
        self.host, self.timeout_s, self.rank = host, float(timeout_s), int(rank)
        self.receivers, self.group = tuple(receivers), int(group)
        self.server = server_for(host)

    @property
    def address(self) -> str:
        """Where engines connect to this sender."""
        return str(self.server.address())

    def serve(self, receivers: Iterable[int], group: int) -> None:
        """Set the group ranks that pull the next versions and the plan's generation."""
        self.receivers, self.group = tuple(int(r) for r in receivers), int(group)

    def send(self, manifest: Manifest, tensors: Iterable[tuple[str, Any]]) -> SendStats:
        """Schedule one pull of this sender's blocks of `manifest.version` per receiver and
        return at once (the commit is the engines' "loaded" acks).

        Args:
            tensors: (name, blocks) in manifest order, for a manifest with `sources`: this
                sender's blocks of each tensor (a list, in source order; empty when it holds
                none), JAX arrays on one device each (or numpy, placed on this process's
                first device); without `sources` (name, whole array): sender 0 serves every
                tensor whole (an array over several devices is gathered onto one first).

        Raises:
            ManifestError: a name, order, block count or block shape differs from the
                manifest. TransferError: no receivers set.
        """
        import jax
        import numpy as np

        if not self.receivers:
            raise TransferError("jax_transfer: no receivers to serve (serve() first)")
        t0 = time.perf_counter()
        device = jax.local_devices()[0]
        arrays = [jax.device_put(np.frombuffer(manifest.fingerprint(), np.uint8), device)]
        served = 0
        it = iter(tensors)
        for i, spec in enumerate(manifest.tensors):
            try:
                name, got = next(it)
            except StopIteration:
                raise ManifestError(f"tensors ran out at {spec.name!r}") from None
            if name != spec.name:
                raise ManifestError(f"tensor {i}: got {name!r}, manifest says {spec.name!r}")
            boxes = boxes_of(manifest, i, self.rank)
            blocks = list(got) if manifest.sources else [got] if self.rank == 0 else []
            if len(blocks) != len(boxes):
                raise ManifestError(
                    f"{name}: sender {self.rank} holds {len(boxes)} blocks, got {len(blocks)}"
                )
            for box, block in zip(boxes, blocks, strict=True):
                want = tuple(s.stop - s.start for s in box)
                if tuple(block.shape) != want:
                    raise ManifestError(f"{name}: block {list(block.shape)}, box {list(want)}")
                arrays.append(_wire(block, spec.dtype, device))
                served += int(np.prod(want)) * DTYPE_BYTES[spec.dtype]
        if next(it, None) is not None:
            raise ManifestError("more tensors than the manifest lists")
        deadline = _deadline(self.timeout_s)
        for r in self.receivers:
            self.server.await_pull(pull_id(manifest.version, self.group, r), arrays, deadline)
        return SendStats(manifest.version, served, 1, time.perf_counter() - t0)


class JaxTransferReceiver(WeightReceiver):
    """An engine's side: pulls each version from every sender onto `device`.

    Args:
        servers: sender s's address is `servers[s]`.
        rank: this engine's group rank (its pull ids).
        group: the plan's group generation.
        timeout_s: seconds a version may take to arrive whole.
        host: the address this process's own server binds to (the library connects from a
            server).
        device: where the tensors land (default: this process's first local device).
    """

    def __init__(
        self,
        servers: tuple[str, ...],
        rank: int,
        group: int = 0,
        timeout_s: float = 300.0,
        host: str = "127.0.0.1",
        device: Any = None,
    ) -> None:
        import jax

        if not servers:
            raise TransferError("jax_transfer: the plan names no sender addresses")
        self.servers, self.rank, self.group = tuple(servers), int(rank), int(group)
        self.timeout_s = float(timeout_s)
        self.device = device if device is not None else jax.local_devices()[0]
        self._server = server_for(host)
        self._connections: dict[str, Any] = {}

    def _connection(self, address: str) -> Any:
        conn = self._connections.get(address)
        if conn is None:
            try:
                conn = self._server.connect(address)
            except Exception as e:  # noqa: BLE001 - the library raises its own runtime errors
                raise TransferError(f"jax_transfer: cannot connect to {address}: {e}") from e
            self._connections[address] = conn
        return conn

    def pull(self, manifest: Manifest) -> dict[str, Any]:
        """Pull `manifest.version` from every sender and assemble each tensor on `device`.

        Returns:
            HF name -> JAX array of the tensor's full shape and manifest dtype, on `device`,
            in manifest order.

        Raises:
            ManifestError: `manifest.senders` exceeds the senders the plan names.
            TransferError: a sender offered another manifest (refused), a pull did not
                arrive within `timeout_s` (a sender died or never served it), or failed.
        """
        import jax
        import jax.numpy as jnp

        if manifest.senders > len(self.servers):
            raise ManifestError(
                f"the manifest has {manifest.senders} senders, the plan names "
                f"{len(self.servers)} addresses"
            )
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        uid = pull_id(manifest.version, self.group, self.rank)
        deadline = time.monotonic() + self.timeout_s
        pulled: list[list[Any]] = []
        for s in range(manifest.senders):
            specs = [jax.ShapeDtypeStruct((FINGERPRINT_BYTES,), jnp.uint8, sharding=sharding)]
            for i, spec in enumerate(manifest.tensors):
                for box in boxes_of(manifest, i, s):
                    shape = tuple(b.stop - b.start for b in box)
                    specs.append(
                        jax.ShapeDtypeStruct(shape, jnp.dtype(spec.dtype), sharding=sharding)
                    )
            conn = self._connection(self.servers[s])
            try:
                pulled.append(conn.pull(uid, specs, _deadline(self.timeout_s)))
            except Exception as e:  # noqa: BLE001 - the library raises its own runtime errors
                raise TransferError(f"jax_transfer: pull from sender {s} failed: {e}") from e
        for s, arrays in enumerate(pulled):
            self._wait(arrays, deadline, s, manifest.version)
            if bytes(memoryview(jax.device_get(arrays[0]))) != manifest.fingerprint():
                raise TransferError(
                    f"refused: sender {s} ({self.servers[s]}) offered another manifest than "
                    f"version {manifest.version}'s"
                )
        out: dict[str, Any] = {}
        taken = [1] * manifest.senders  # next block of each sender's list
        for i, spec in enumerate(manifest.tensors):
            pieces = []
            for s, region in sources_of(manifest, i):
                pieces.append((region, pulled[s][taken[s]]))
                taken[s] += 1
            if len(pieces) == 1:
                out[spec.name] = pieces[0][1]
                continue
            full = jnp.zeros(spec.shape, jnp.dtype(spec.dtype), device=self.device)
            for region, block in pieces:
                full = full.at[region].set(block)
            out[spec.name] = full
        return out

    def _wait(self, arrays: list[Any], deadline: float, sender: int, version: int) -> None:
        """Poll until every pulled array is ready (the library's own pull timeout does not
        fire when the sender never scheduled the pull); raise `TransferError` past the
        deadline or when the transfer failed."""
        pause = 0.001
        while not all(a.is_ready() for a in arrays):
            if time.monotonic() > deadline:
                raise TransferError(
                    f"jax_transfer: version {version} from sender {sender} "
                    f"({self.servers[sender]}) did not arrive within {self.timeout_s} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        try:
            for a in arrays:
                a.block_until_ready()
        except Exception as e:  # noqa: BLE001 - a failed transfer is an error array
            raise TransferError(f"jax_transfer: pull from sender {sender} failed: {e}") from e

    def receive(self, manifest: Manifest, on_bucket: OnBucket) -> None:
        """The torch-facing form (`WeightReceiver.receive`): `pull`, then each bucket of
        `manifest.buckets()` handed to `on_bucket` as host torch tensors."""
        import numpy as np

        from transport.base import as_torch

        tensors = self.pull(manifest)
        for bucket in manifest.buckets():
            names = [manifest.tensors[i].name for i in bucket]
            on_bucket([(n, as_torch(np.asarray(tensors[n]))) for n in names])

    def close(self) -> None:
        """Drop the connections (the process's server stays for the next group)."""
        self._connections.clear()
