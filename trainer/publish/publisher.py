"""The trainer side of a weight push: JAX params -> engine tensors -> data plane -> engines.

`WeightPublisher.push(model, version)`:
1. lists the live engines (gateway status) and, for a collective transport, forms the
   data-plane group of their TP ranks (a new group when the engines changed or the last push
   failed: a failed collective leaves a group out of step);
2. builds the manifest from the family's mapping (HF names, full shapes, the wire dtype) and
   publishes the version with a `transport.sync_plan.SyncPlan` in its params;
3. waits until every engine of the group reached a safe point ("ready");
4. streams the tensors, one at a time, through `params_to_engine` (the mapping's layout) into
   buckets of `bucket_bytes`. A param held whole on one CPU device reaches the packing copy
   as a strided view of its own buffer (`np.asarray` shares a CPU buffer, the layout change
   is a view, `transport.base.as_torch` keeps the strides): that one torch copy into
   the bucket casts to the wire dtype and transposes in a single pass. A param on an
   accelerator or split over devices is cast to the wire dtype in JAX first (one tensor at a
   time), so only wire-dtype bytes leave the device. When every engine runs one TP degree > 1
   (and the transport's `tp_shards` is on) the manifest is sharded: each engine TP rank
   receives only its own shard of each tensor, copied straight out of the trainer's FSDP
   shards when the param is split over devices (`transport.sharded`);
5. waits until every engine acknowledged "loaded".

Over jax_transfer (`transport.jax_transfer`) step 4 is different: the engine tensors are made
in JAX and stay on the trainer's devices, one block per distinct shard
(`local_shards.local_blocks`, as with several trainer processes; the manifest names each
block's sender and box), and the sender schedules one pull of them per engine; each engine
pulls them onto its own device, and step 5's "loaded" acks are the commit. The plan carries
the senders' server addresses and the group generation (part of every pull id).

Elastic pushes. A push goes to the engines registered when it starts (at least `min_engines`;
it waits up to `ready_timeout_s` for them, so a restarted engine can come back). An engine
that dies during it is dropped from it and the version commits on the rest:
- file transport and delta stream: the dead engine is removed from the waits; nothing else
  changes (the delta stream's one sender lives as long as the publisher: an engine that
  comes back connects again and gets a keyframe, the others keep their streams).
- collective (gloo/NCCL: one process group with every engine TP rank as a rank): a dead rank
  breaks the group. Before the send, the group cannot form (the wait for "ready" sees the
  member gone), or the members already in the receive on an unchanged group fail it first
  (gloo's broadcast tree runs through the dead rank) and their failure is pinned on the
  member the gateway drops within `peer_grace_s`; during it, the broadcast or the commit
  all-reduce fails at once on every rank (gloo: "Connection closed by peer"), and the
  gateway has dropped the engine because its heartbeat stream broke, which names it
  (`peer_grace_s`). Either way the publisher closes the group (survivors' pending
  collectives fail, they ack "failed" and keep serving their old version), waits for them
  to settle (`settle_s`), forms a new group of the survivors (a new generation and
  rendezvous port) and publishes the same version again with the new plan: the gateway
  treats that as a re-plan (it forgets the survivors' failed acks of the broken attempt and
  wakes their heartbeat long polls), the engines see the same version on a new group and
  load it. After `max_attempts` groups, or with fewer than `min_engines`
  survivors, the push fails with `PushError`.
- after the commit (every receiver voted), an engine that dies before it acknowledged
  "loaded" leaves the others loaded; if fewer than `min_engines` did, the push waits for
  engines to register (a restart, up to `ready_timeout_s`, as before the commit) and re-plans
  the version on those that do not hold it yet.
Engines that register during a push are left out of it; they lease nothing until they loaded
the version current when they registered (the gateway holds them back), which they receive
with the next push, or sooner from `start_catch_up`'s thread, which re-sends the last version
from a host copy to engines behind it while no push runs (a run whose only engine died and
came back has no next push until that engine serves).

Near and far engines in one push (a mixed plan, `far_transport` and `far_names`): the engines
registered under a far name (`transport.sync_plan.is_far_name`) are fed over the delta stream,
every other engine over the run's data plane (gloo, shm or file), from one publication of the
version whose plan carries both legs (`transport.sync_plan.FarLeg`). Right after the
publication the version is handed to the delta stream's sender (it packs and keeps it, and
returns: `transport.delta_stream`); the push then runs on the near engines alone as above
(they are its members: the group, the waits, `min_engines`, the commit, re-plans and
catch-up). A far engine is never waited for: it pulls the version (or a newer one, when it
skipped) as a delta against the one it holds, loads it and acks "loaded" on its own time,
leasing meanwhile on the version it holds (within `max_lag`, the prompts' `min_version`).

Extra trainer memory is bounded by one bucket (which a collective sender keeps between
pushes: packing into a reused buffer avoids its page faults, `transport.base.
BufferPool`), plus, for a param on an accelerator or split over devices, that one tensor in
its wire dtype (and its transposed copy when the mapping transposes it). A sharded bucket is
packed once per TP rank: the per-rank buffers add up to the bucket, plus each KV tensor once
more per extra rank that holds its head when TP exceeds the KV heads.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from gateway.client import GatewayClient
from gateway.errors import GatewayError
from mappings.apply import params_to_engine
from mappings.registry import get_family
from mappings.spec import Family, expand
from models.checkpoints.peft_io import peft_tensors
from models.checkpoints.peft_layout import adapter_shapes
from trainer.publish.host_views import HostView, flat_of, host_copies
from trainer.publish.local_shards import LocalBlocks, engine_arrays, local_blocks
from trainer.publish.waits import EngineWaits, MembersLost, PushError, gone_from, ids_of
from transport.adapter_spec import AdapterSpec
from transport.base import SendStats, TransferError, WeightSender
from transport.collective import CollectiveSender
from transport.config import (
    DeltaStreamTransportConfig,
    JaxTransferTransportConfig,
    TransportConfig,
    is_collective,
    serves_blocks,
)
from transport.delta_stream import DeltaStreamSender
from transport.factory import make_sender
from transport.jax_transfer import JaxTransferSender
from transport.manifest import Manifest
from transport.sync_plan import FarLeg, SyncPlan, is_far_name

log = logging.getLogger("trainer.publish")

WIRE_DTYPES = ("bfloat16", "float32", "float16")
NEAR_KINDS = ("gloo", "shm", "file")
"""The data planes near engines may take in a mixed plan (whole versions from process 0)."""


@dataclass(frozen=True)
class PushStats:
    """One push, end to end.

    Attributes:
        version: the version every engine now serves.
        num_bytes: payload bytes (sum of the wire tensors).
        num_tensors, num_buckets: tensors sent and buckets they travelled in.
        engines: engine ids that loaded it.
        ready_s: publish -> every engine at a safe point. send_s: the data-plane send (every
            receiver committed). loaded_s: send end -> every engine acknowledged "loaded".
        seconds: the whole push.
        tp_size: the engine TP degree the version was sharded for (each TP rank received only
            its own shards); 1 when every rank received whole tensors.
        dropped: engines that were alive when the push began and left during it.
        attempts: data-plane groups it took (1 + the re-plans after members died).
        sent_bytes: payload bytes this process sent in the attempt that committed (a
            broadcast counted once; with several trainer processes, only its own blocks).
        send_phases: seconds of `send_s` by phase where the transport times them
            (`transport.base.SendStats.phases`: for gloo/NCCL "offer_s", "pack_s",
            "wire_s", "commit_s"); empty otherwise.
    """

    version: int
    num_bytes: int
    num_tensors: int
    num_buckets: int
    engines: tuple[str, ...]
    ready_s: float
    send_s: float
    loaded_s: float
    seconds: float
    tp_size: int = 1
    dropped: tuple[str, ...] = ()
    attempts: int = 1
    sent_bytes: int = 0
    send_phases: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        """Payload GB/s (1e9 bytes) over the whole push."""
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9

    @property
    def send_gb_per_s(self) -> float:
        """Payload GB/s of the data-plane send alone (cast, layout, pack, move, load)."""
        return self.num_bytes / max(self.send_s, 1e-9) / 1e9


class WeightPublisher:
    """Pushes JAX params to every registered engine (see the module docstring).

    Args:
        client: a trainer-role `GatewayClient`.
        transport: the data plane (`transport.config.*TransportConfig`); a gloo/nccl
            port of 0 picks a free one per group. Its `bucket_bytes` is the bucket size.
        family: the mapping family (name or `Family`).
        cfg: the model's `ModelConfig`.
        dtype: wire dtype (torch name): the engines' dtype; bf16 by default.
        ready_timeout_s, loaded_timeout_s: limits of the two waits on the engines.
        jax_dims: JAX-side sizes that differ from the checkpoint's (a padded "V").
        min_engines: fewest engines a push may commit on (>= 1, `launch.min_engines`).
        max_attempts: data-plane groups one push may form (>= 1): the first, plus one re-plan
            per wave of members that died during it.
        settle_s: most seconds a re-plan waits for the survivors to end the broken attempt.
        peer_grace_s: most seconds a data-plane error waits for the gateway to drop the dead
            member (its connection broke), so the error can name it.
        senders: trainer processes that send each version together (fan-in,
            `transport.fan_in`); above 1 this is process 0's publisher, pushes go through
            `push_blocks`, and the transport must be one every process sends on (gloo,
            NCCL, jax_transfer: `transport.config.serves_blocks`).
        announce: with `senders` > 1, called with each plan right after it is published,
            to have the other processes join the group as senders (`trainer.leader`).
        far_transport: with `far_names`, the delta stream the far engines pull from (a mixed
            plan, see "Near and far engines" above); None: every engine takes `transport`.
        far_names: registered names of the far engines (`is_far_name`).
        adapter: push only the LoRA adapters (`sync.lora_only`): each version's manifest
            lists A [r, in] and B [out, r] of every adapted projection in PEFT naming and
            carries this spec (rank, alpha, targets); the model pushed must hold those
            adapters (`models.lora`), and the engines must have started with the same rank
            and targets. None (default): the whole model, adapters merged.

    Raises:
        ValueError: an unknown wire dtype, min_engines or max_attempts < 1; an adapter push
            with several senders or over jax_transfer (whole-model paths only); far engines
            with a near data plane other than gloo, shm or file, with several senders, or
            with far_names and far_transport not given together.
        OSError: the far engines' sender cannot listen at far_transport's host and port.
    """

    def __init__(
        self,
        client: GatewayClient,
        transport: TransportConfig,
        family: str | Family,
        cfg: Any,
        dtype: str = "bfloat16",
        *,
        ready_timeout_s: float = 120.0,
        loaded_timeout_s: float = 600.0,
        jax_dims: Mapping[str, int] | None = None,
        min_engines: int = 1,
        max_attempts: int = 4,
        settle_s: float = 30.0,
        peer_grace_s: float = 5.0,
        senders: int = 1,
        announce: Callable[[SyncPlan], None] | None = None,
        adapter: AdapterSpec | None = None,
        far_transport: DeltaStreamTransportConfig | None = None,
        far_names: tuple[str, ...] = (),
    ) -> None:
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"dtype: expected one of {WIRE_DTYPES}, got {dtype!r}")
        if senders > 1 and (not serves_blocks(transport) or announce is None):
            raise ValueError(
                f"senders={senders}: several trainer processes send over gloo, nccl or "
                f"jax_transfer only, "
                f"with an announce callback (got transport {transport.kind!r})"
            )
        if (far_transport is None) != (not far_names) or (
            far_names and (senders > 1 or transport.kind not in NEAR_KINDS)
        ):
            raise ValueError(
                f"far engines {list(far_names)} (delta stream {far_transport is not None}): "
                f"expected far_names with far_transport, one sender and a near data plane of "
                f"{NEAR_KINDS}; got senders={senders}, transport {transport.kind!r}"
            )
        if min_engines < 1 or max_attempts < 1:
            raise ValueError(
                f"min_engines, max_attempts: expected >= 1, got {min_engines}, {max_attempts}"
            )
        self.max_attempts = max_attempts
        self.client = client
        self.transport = transport
        self.family = get_family(family) if isinstance(family, str) else family
        self.cfg = cfg
        self.dtype = dtype
        self.far_transport, self.far_names = far_transport, tuple(far_names)
        self.waits = EngineWaits(
            client, is_collective(transport), min_engines,
            ready_timeout_s, loaded_timeout_s, settle_s, peer_grace_s, self.is_far,
        )  # fmt: skip
        self._far_layout: Manifest | None = None
        self.pushes: list[PushStats] = []
        self.jax_dims = dict(jax_dims or {})
        self._sender: WeightSender | None = None
        self._members: tuple[tuple[str, int], ...] = ()
        self._generation = 0
        rules = expand(self.family, cfg, self.jax_dims)
        self._shapes = [(r.hf, r.hf_shape) for r in rules]
        self._layouts: dict[int, Manifest] = {}  # TP degree -> the manifest of version 0
        self._shards = {r.hf: r.rule.shard_kind for r in rules if r.rule.tp_dim is not None}
        self.adapter = adapter
        if adapter is not None:  # PEFT-named A and B only, whole to every engine TP rank
            if senders > 1 or isinstance(transport, JaxTransferTransportConfig):
                raise ValueError(
                    "an adapter-only push (sync.lora_only) goes from one trainer process over "
                    f"gloo, nccl, shm or file; got senders={senders}, transport {transport.kind!r}"
                )
            self._shapes = adapter_shapes(cfg, adapter.targets, adapter.rank)
            self._shards = {}
        self._lock = threading.Lock()  # one push (or catch-up) at a time
        self._last: tuple[int, dict[str, np.ndarray]] | None = None
        self._keep_last = False
        self._catch_up_stop = threading.Event()
        self._catch_up_thread: threading.Thread | None = None
        self.senders = senders
        self._announce = announce
        self._blocks: LocalBlocks | None = None
        # jax_transfer serves blocks on the trainer's devices, one process or several
        self._by_blocks = isinstance(transport, JaxTransferTransportConfig)
        # the delta stream: one sender for the whole run, whichever engines come and go
        self._serves_any = isinstance(transport, DeltaStreamTransportConfig)
        # the far engines' sender listens from the start: a port taken fails here, not mid-run
        self._far_sender: DeltaStreamSender | None = (
            make_sender(far_transport) if far_transport is not None else None  # type: ignore[assignment]
        )

    def start_catch_up(self, interval_s: float = 0.5) -> None:
        """From now on keep a host copy of each pushed version (its engine tensors in the
        params' dtype: the model's bytes once more in host memory, copied after every push)
        and, every `interval_s` seconds while no push runs, re-send it to every registered
        engine that does not hold it (`catch_up`): an engine restarted while the trainer waits
        for rollouts gets the current version without waiting for a push that, with no other
        engine serving, would never come. Stopped by `close`."""
        self._keep_last = True
        if self._catch_up_thread is None:
            self._catch_up_thread = threading.Thread(
                target=self._catch_up_loop, args=(interval_s,), name="catch-up", daemon=True
            )
            self._catch_up_thread.start()

    def _catch_up_loop(self, interval_s: float) -> None:
        said = ""  # a gateway that is away (stopping, restarting) is said once, not per tick
        while not self._catch_up_stop.wait(interval_s):
            try:
                self.catch_up()
                said = ""
            except GatewayError as e:
                if str(e) != said:
                    log.warning("catching engines up: %s (retried every %g s)", e, interval_s)
                said = str(e)
            except Exception:  # noqa: BLE001 - retried at the next tick; pushes report errors
                log.exception("catching engines up failed")

    def catch_up(self) -> tuple[str, ...]:
        """Re-send the last pushed version (from its host copy) to the registered engines
        behind it, as a re-plan of that version on a group of those engines only; returns the
        engines that loaded it (empty when none was behind, a push is running, or nothing
        was kept yet).

        Raises:
            PushError: an engine failed to load it; GatewayError: the gateway refused.
        """
        if self._last is None or not self._lock.acquire(blocking=False):
            return ()
        try:
            version, tensors = self._last
            status = self.client.status()
            if int(status.current_version) != version:
                return ()
            behind = tuple(
                sorted(
                    (e.engine_id, max(1, e.tp_size))
                    for e in status.engines
                    if e.weight_version < version and not self.is_far(e.name)
                )
            )
            if not behind:
                return ()
            log.info("catching %s up to version %d", list(ids_of(behind)), version)
            return self._push_once(tensors, version, behind).engines
        finally:
            self.waits.cancelled.clear()
            self._lock.release()

    def manifest(self, version: int, tp_size: int = 1) -> Manifest:
        """The manifest of `version`: every engine tensor, in sending order, wire dtype.

        Args:
            tp_size: the engines' TP degree; above 1 the manifest is sharded (each TP rank
                receives only its own shard of every tensor the mapping gives a `tp_dim`).

        The tensor list is made once per TP degree (`_layouts`) and stamped with each
        version; the engines get it once, in the sync plan (the data plane offers only its
        fingerprint, `Manifest.fingerprint`).

        Raises:
            ManifestError: a tensor that does not split over `tp_size`.
        """
        layout = self._layouts.get(tp_size)
        if layout is None:
            layout = Manifest.of(0, self._shapes, self.dtype, self.transport.bucket_bytes)
            layout = dataclasses.replace(layout, adapter=self.adapter)
            if tp_size > 1:
                layout = layout.sharded_for(
                    tp_size, self._shards, num_kv_heads=self.cfg.num_kv_heads
                )
            self._layouts[tp_size] = layout
        return dataclasses.replace(layout, version=version)

    def push(self, model_or_params: Any, version: int) -> PushStats:
        """Push `version` to the engines alive when it starts and return once each survivor
        serves it (see "Elastic pushes" in the module docstring).

        Args:
            model_or_params: a `Decoder`, or its flat params by dot path (arrays of the
                model's shapes; `models.params.flat_params`).
            version: the new version (> the gateway's current one).

        Raises:
            PushError: fewer than `min_engines` engines serve (within `ready_timeout_s` at
                the start, or after engines died during the push), a live engine failed to
                load it (its error inside), a wait ran out, or `max_attempts` re-plans were
                not enough.
            GatewayError: the gateway refused the publication (e.g. a version not above the
                current one).
            PushError: also when `cancel_push` ended it.
        """
        if self.senders > 1:
            raise TypeError("a publisher of several senders pushes with push_blocks")
        params = flat_of(model_or_params, merged=self.adapter is None)
        if self._by_blocks:  # this process's blocks stay on its devices (jax_transfer)
            tensors = engine_arrays(self.family, self.cfg, params, self.dtype, self.jax_dims)
            return self.push_blocks(local_blocks(tensors, version, 0, on_device=True))
        with self._lock:
            try:
                stats = self._push(params, version)
            finally:
                self.waits.cancelled.clear()
            if self._keep_last:
                self._last = (version, self._host_copy(params))
            return stats

    def cancel_push(self) -> None:
        """End the push in flight (from another thread: a stop while a background push
        runs, `trainer.publish.background`): its waits before the publication and after the
        send raise `PushError` at their next poll (at most a second). The part between, from
        the engines' "ready" to the end of the send, runs to its end (bounded by the
        transport's `timeout_s`): engines that acked "ready" are entering the receive, and
        leaving them there would block them until that timeout. Called while no push runs,
        it ends the next one (or the next catch-up) at its first cancellable wait: the caller
        is stopping."""
        self.waits.cancelled.set()

    def push_blocks(self, blocks: LocalBlocks) -> PushStats:
        """As `push`, for process 0 of several sending trainer processes (`senders` > 1):
        `blocks` are process 0's blocks of the version (`local_blocks`; the others made
        theirs in the same collective and join each plan as senders when `announce` tells
        them). The blocks are host copies already: they are kept as the catch-up copy.

        Raises: as `push`.
        """
        with self._lock:
            self._blocks = blocks
            stats = self._push(blocks.mine, blocks.version)
            self._last = (blocks.version, blocks.mine)  # type: ignore[assignment]
            return stats

    def _host_copy(self, params: Mapping) -> dict[str, np.ndarray]:
        """The engine tensors of `params` as host arrays, written into the previous copy's
        buffers when they fit (no page faults after the first push, which made a copy into
        fresh arrays several times slower than one into kept ones)."""
        old = self._last[1] if self._last is not None else {}
        return host_copies(self._engine_tensors(params), old)

    def _push_once(
        self, tensors: Mapping[str, np.ndarray], version: int, members: tuple
    ) -> PushStats:
        """One attempt of `version` from host engine tensors (HF names and layout) to
        `members`: publish, ready, send, loaded (no re-plan; the group is dropped on failure)."""
        t0 = time.perf_counter()
        sender, plan = self._plan(members, version)
        self.client.publish_version(version, plan.to_params())
        if self._announce is not None:
            self._announce(plan)
        try:
            self._hand_to_far(plan, tensors.items())
            ids = self.waits.wait(version, "ready", ids_of(members))
            t1 = time.perf_counter()
            # whole tensors in HF layout and manifest order; a sharded sender slices them
            self._connect(sender, version, ids_of(members))
            send = sender.send(plan.manifest, iter(tensors.items()))
            t2 = time.perf_counter()
            ids = self.waits.wait(version, "loaded", ids)
        except MembersLost as e:
            self._drop_group()
            raise PushError(version, str(e)) from e  # the next tick catches up the rest
        except BaseException:
            self._drop_group()
            raise
        t3 = time.perf_counter()
        stats = PushStats(
            version, plan.manifest.total_bytes, len(self._shapes), send.num_buckets, ids,
            t1 - t0, t2 - t1, t3 - t2, t3 - t0, plan.manifest.tp_size,
            sent_bytes=send.num_bytes, send_phases=send.phases,
        )  # fmt: skip
        self.pushes.append(stats)
        return stats

    def _push(self, params: Mapping, version: int) -> PushStats:
        t0 = time.perf_counter()
        members, done = self.waits.live_engines(version)
        lost: list[str] = []
        # done: loaded it in a committed attempt with too few others, or came back holding it
        for attempt in range(self.max_attempts):
            sender, plan = self._plan(members, version)
            self.client.publish_version(version, plan.to_params())
            if self._announce is not None:
                self._announce(plan)
            try:
                self._hand_to_far(plan, self._engine_tensors(params))
                ids = self.waits.wait(version, "ready", ids_of(members))
                if len(ids) < len(members) and (self.waits.collective or not ids):
                    raise MembersLost(gone_from(members, ids), "before the send")
                t1 = time.perf_counter()
                send = self._send(sender, plan.manifest, params, ids_of(members))
                t2 = time.perf_counter()
                # after the commit every receiver voted: a death now leaves the rest loaded
                ids = self.waits.wait(version, "loaded", ids)
                if len(done) + len(ids) < self.waits.min_engines:  # wait for a restart, as
                    done += ids  # before the commit, and re-send the version to it
                    raise MembersLost(gone_from(members, ids), "after the commit")
            except MembersLost as e:
                self._drop_group()  # a broken collective leaves the group out of step
                lost += e.gone
                survivors = ids_of(tuple(x for x in members if x[0] not in e.gone))
                self.waits.settle(version, survivors)
                # the engines registered now: the survivors, and any that came back (a
                # restart) meanwhile; below min_engines this waits for them (ready_timeout_s)
                live, holding = self.waits.live_engines(version, lost)
                done = tuple(sorted(set(done) | set(holding)))  # a restart may hold it
                members = tuple(x for x in live if x[0] not in lost and x[0] not in done)
                log.warning(
                    "push of version %d: engines %s left %s (attempt %d); re-sending it to %s",
                    version, e.gone, e.when, attempt + 1, list(ids_of(members)),
                )  # fmt: skip
                self.waits.check_enough(
                    version, len(done) + len(members), f"after {lost} left during the push"
                )
                if not members:  # every engine serving it holds it: nothing left to send
                    return self._held_by(done, version, lost, attempt + 1, t0)
                continue
            except BaseException:
                self._drop_group()  # a failed collective leaves the group out of step
                raise
            t3 = time.perf_counter()
            gone_late = [e for e in ids_of(members) if e not in ids]
            ids = tuple(sorted(done + ids))
            stats = PushStats(
                version, plan.manifest.total_bytes, len(self._shapes), send.num_buckets, ids,
                t1 - t0, t2 - t1, t3 - t2, t3 - t0, plan.manifest.tp_size,
                tuple(lost + gone_late), attempt + 1, send.num_bytes, send.phases,
            )  # fmt: skip
            log.info(
                "pushed version %d: %.1f MB to %d engines in %.2f s (send %.2f GB/s)",
                version, stats.num_bytes / 1e6, len(ids), stats.seconds, stats.send_gb_per_s,
            )  # fmt: skip
            self.pushes.append(stats)
            return stats
        raise PushError(
            version, f"engines kept leaving: {lost} within {self.max_attempts} attempts"
        )

    def _held_by(
        self, engines: tuple[str, ...], version: int, lost: list[str], attempts: int, t0: float
    ) -> PushStats:
        """The stats of a push that ends with no send left: every engine serving `version`
        already holds it (`engines`: loaded it in an earlier attempt of this push, or
        registered again with it after it left)."""
        seconds = time.perf_counter() - t0
        manifest = self.manifest(version)
        stats = PushStats(
            version, manifest.total_bytes, len(self._shapes), 0, engines, 0.0, 0.0, 0.0,
            seconds, 1, tuple(lost), attempts,
        )  # fmt: skip
        log.info(
            "pushed version %d: the %d engines serving it hold it already (%.2f s)",
            version, len(engines), seconds,
        )  # fmt: skip
        self.pushes.append(stats)
        return stats

    @property
    def delta_pushes(self) -> list[dict[str, Any]]:
        """With the delta stream (the run's data plane, or the far engines' of a mixed
        plan): every version its sender sent an engine, in order
        (`transport.delta_stream.FarPush` as a dict: engine, version, base (None: keyframe),
        wire_bytes, payload_bytes, seconds, encode_s, loaded, at); [] with any other
        transport or before the first push."""
        sender = self._far_sender or self._sender
        if not isinstance(sender, DeltaStreamSender):
            return []
        return [dataclasses.asdict(p) for p in list(sender.pushes)]

    def is_far(self, name: str) -> bool:
        """Whether the engine registered as `name` is a far engine (`far_names`)."""
        return is_far_name(name, self.far_names)

    def close(self) -> None:
        """Stop catching engines up; release the sender (and its group) and the far
        engines' delta stream."""
        self._catch_up_stop.set()
        if self._catch_up_thread is not None:
            self._catch_up_thread.join(10.0)
        self._drop_group(final=True)
        if self._far_sender is not None:
            self._far_sender.close()
            self._far_sender = None

    # ----- steps -----
    def _plan(
        self, members: tuple[tuple[str, int], ...], version: int
    ) -> tuple[WeightSender, SyncPlan]:
        changed = members != self._members
        if self._sender is None or (changed and not self._serves_any):
            self._drop_group()
            receivers = sum(tp for _, tp in members)
            self._sender = make_sender(
                self.transport, num_receivers=receivers, senders=self.senders
            )
            self._generation += 1
        elif changed:  # the delta stream's sender stays; engines tell the new plan by it
            self._generation += 1
        self._members = members
        ranks, offset = {}, self.senders
        for engine_id, tp in members:
            ranks[engine_id] = offset
            offset += tp
        transport = self.transport.model_dump()
        if is_collective(self.transport) or self._serves_any:
            transport["port"] = int(self._sender.port)  # type: ignore[attr-defined]
        if isinstance(self._sender, JaxTransferSender):  # the engines pull from these
            transport["servers"] = list(self.transport.servers) or [self._sender.address]  # type: ignore[union-attr]
            transport["group"] = self._generation
            self._sender.serve(ranks.values(), self._generation)
        manifest = self.manifest(version, self._shard_tp(members))
        if self.senders > 1 or self._by_blocks:
            if self._blocks is None or self._blocks.version != version:
                raise PushError(version, "no blocks of this version to send (push_blocks)")
            sources = self._blocks.sources_for(manifest)
            manifest = dataclasses.replace(manifest, senders=self.senders, sources=sources)
        far = self._far_leg(version)
        plan = SyncPlan(transport, manifest, ranks, offset, self._generation, far)
        return self._sender, plan

    def _far_leg(self, version: int) -> FarLeg | None:
        """The far engines' leg of `version`'s plan; None without far engines.

        Raises:
            PushError: the publisher was closed (its far sender with it)."""
        cfg = self.far_transport
        if cfg is None:
            return None
        if self._far_sender is None:
            raise PushError(version, "the publisher is closed (no far sender)")
        if self._far_layout is None:
            layout = Manifest.of(0, self._shapes, self.dtype, cfg.bucket_bytes)
            self._far_layout = dataclasses.replace(layout, adapter=self.adapter)
        transport = {**cfg.model_dump(), "port": int(self._far_sender.port)}  # type: ignore[union-attr]
        manifest = dataclasses.replace(self._far_layout, version=version)
        return FarLeg(self.far_names, transport, manifest)

    def _hand_to_far(self, plan: SyncPlan, tensors: Iterable[tuple[str, Any]]) -> None:
        """Hand the version to the far engines' sender (it packs and keeps it and returns;
        a version it keeps already is left as it is); a no-op without far engines."""
        if plan.far is not None and self._far_sender is not None:
            self._far_sender.send(plan.far.manifest, tensors)

    def _shard_tp(self, members: tuple[tuple[str, int], ...]) -> int:
        """The TP degree to shard for: the engines' one TP degree when the transport is a
        collective one with `tp_shards` on, else 1 (whole tensors to every rank)."""
        sizes = {tp for _, tp in members}
        if not is_collective(self.transport) or not self.transport.tp_shards or self.adapter:
            return 1
        return sizes.pop() if len(sizes) == 1 else 1

    def _drop_group(self, final: bool = False) -> None:
        """Close the sender (a collective group out of step, or members changed); the delta
        stream's sender is kept until `close` (`final`): it serves whichever engines connect,
        and the versions it keeps are the bases of each engine's next delta."""
        if self._serves_any and not final:
            return
        if self._sender is not None:
            self._sender.close()
        self._sender, self._members = None, ()

    def _send(
        self, sender: WeightSender, manifest: Manifest, params: Mapping, ids: tuple[str, ...]
    ) -> SendStats:
        """The data-plane send. A transfer error is pinned on the group members the gateway
        drops within `peer_grace_s` (their connection broke): `MembersLost` names them; with
        none gone it is a `PushError` with the engines' own errors."""
        if manifest.sources:  # process 0's own blocks of every tensor
            items: Iterator[tuple[str, Any]] = iter(params.items())
        elif manifest.sharded:
            items = self._sharded_tensors(params)
        else:
            items = self._engine_tensors(params)
        try:
            self._connect(sender, manifest.version, ids)
            return sender.send(manifest, items)
        except TransferError as e:
            states = self.waits.pin_on_lost(manifest.version, ids, f"during the send ({e})", e)
            errors = {s.engine_id: s.error for s in states if s.phase == "failed"}
            raise PushError(manifest.version, f"{e}; engine errors: {errors}", states) from e

    def _connect(self, sender: WeightSender, version: int, ids: tuple[str, ...]) -> None:
        """Form a collective sender's group, giving up as soon as the gateway drops a member
        of `ids` (one that died before it joined would otherwise hold the group for the
        transport's `timeout_s`); a no-op for the file transport.

        Raises:
            TransferError: a member left, or the group did not form.
        """
        if not isinstance(sender, CollectiveSender):
            return

        def abandon() -> str | None:
            gone = self.waits.left(version, ids)[1]
            return f"engines {gone} left" if gone else None

        sender.connect(abandon)

    def _engine_tensors(self, params: Mapping) -> Iterator[tuple[str, Any]]:
        """(HF name, numpy array in the HF layout, possibly strided) one at a time.

        A param held whole on one CPU device (or a numpy array) comes as a view of its own
        buffer in its own dtype: no cast and no transposed copy is made here; the sender's
        packing copy (`transport.base.write_region`, one torch `copy_` into the
        bucket) casts to the wire dtype and transposes in one pass (bit-identical to JAX's
        cast: both round to nearest even); the one fused copy is faster on CPU than a cast in
        JAX, a transposed copy and the packing one after the other. Any other param (on an
        accelerator, or split over devices) is cast to the wire dtype in JAX first, one tensor
        at a time, so only wire-dtype bytes leave the device; its layout change is then a
        strided view too.
        """
        if self.adapter is not None:  # PEFT-named A [r, in], B [out, r]: transposed views
            yield from peft_tensors(params, self.cfg, self.adapter.targets)
            return
        view = HostView(params, jnp.dtype(self.dtype))
        yield from params_to_engine(self.family, self.cfg, view, self.jax_dims, contiguous=False)

    def _sharded_tensors(self, params: Mapping) -> Iterator[tuple[str, Any]]:
        """(HF name, array in the HF layout) one at a time, for a sharded manifest: the sender
        copies each TP rank's region out of it (`transport.sharded`).

        A param split over the trainer's devices stays a JAX array, cast to the wire dtype in
        JAX and still split, so the region is copied straight out of the FSDP shards and no
        whole tensor is gathered (except where a padded `jax_dims` axis is the split one: XLA
        then replicates the unpadded slice). A param held whole on one CPU device (or a numpy array)
        comes as a strided numpy view of its own buffer, uncast, as in `_engine_tensors`: the
        copy of each region casts and transposes in one pass.
        """
        yield from engine_arrays(
            self.family, self.cfg, params, self.dtype, self.jax_dims, host_uncast=True
        )
