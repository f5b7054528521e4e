"""The engine worker loop: one loop for every backend, between the gateway and a backend.

`EngineWorker.run()` registers the engine, keeps a heartbeat going (a long poll, so a sync
directive arrives at once), and runs four asyncio tasks until a stop:

- **lease loop**: while fewer than `max_concurrent_prompts` groups are in flight and no sync
  is pending, lease prompts and hand each to `backend.generate` as its own task. Groups never
  wait for each other: a finished group is returned at once, so one long sample (a straggler)
  holds back nothing but its own slot.
- **returner**: returns finished groups (stamped with the versions of their first and last
  token, and the spans when a sample crossed an update) and releases prompts the engine gave
  up on, batching whatever finished together into one call per lease.
- **sync loop**: on a directive for a version above the one held: stop leasing, ack "ready",
  join the data plane if the directive names a new group, `backend.update_weights(manifest)`,
  ack "loaded", resume. On failure it acks "failed" with the error (see below). A directive
  for the version just attempted but on a new group (the trainer re-planned the push after a
  member of the old group died) is attempted again. Every ack names the plan it answers
  (the directive's `seq`): a failure of a plan the trainer re-planned meanwhile (a restarted
  engine handed the dead group's plan) is ignored by the gateway, never counted against the
  new plan.
- **watchdog**: ends the run when the gateway shuts down, drops the engine, or stays
  unreachable past `gateway_retry_s`.

In-flight requests across an update stay in flight. The worker does not drain them before
acking "ready": draining would make every sync wait for the slowest sample in flight, the
straggler stall this project removes. The backend decides what "in flight" means at its safe
point: vLLM pauses with `mode="keep"` (requests freeze, continue on the new weights with their
KV recomputed); the JAX engine switches each replica between decode calls. Either way each
sample's version spans record the exact switch token, so the trainer can bound staleness per
sample (or drop samples that crossed an update). A prompt leased by a lease call already
under way when the directive came is handed to the backend too; it queues behind the update.

After a failed update the trainer's wait for that version ends with the failure either way.
If the backend still holds a whole version (the plan or the manifest was refused before
anything loaded), the worker acks "failed" with `serving=True` and keeps serving that version:
the groups in flight finish on it, new prompts are leased for it (the gateway's usual
`min_version` checks apply), and all are returned stamped with it. If the backend holds none,
it acks "failed" with `serving=False`: the groups in flight are cancelled and their prompts
released to other engines, and the gateway refuses this engine's leases until it acks
"loaded". Either way a directive for a later version is attempted as usual. A prompt the
backend refuses (too long, sampling it cannot do) is returned as G empty "abort" completions
rather than released, so it cannot circle through the queue forever. A backend whose
inference core died (`rollout_engine.dead_core`: vLLM's EngineDeadError) ends the run with
"backend dead": the worker leases nothing more, releases what it holds, deregisters, and the
engine process exits non-zero (the launcher restarts it within its bound).

Every wait is bounded: lease polls by `lease_wait_s`, the data-plane join and the update by
`connect_timeout_s` and `update_timeout_s`, unreachable-gateway retries by `gateway_retry_s`,
the drain at a stop by `drain_s`, and the whole stop (drain, return, deregister) by `stop_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections import defaultdict

from gateway import messages as m
from gateway.client import GatewayClient
from gateway.errors import NOT_FOUND, GatewayError
from gateway.heartbeat import HeartbeatThread
from rollout_engine.backend import (
    RolloutBackend,
    UpdateStats,
    aborted_group,
    check_prompt,
    group_of,
)
from rollout_engine.calls import EngineDropped, GatewayCaller, GatewayLost
from rollout_engine.config import WorkerConfig
from rollout_engine.dead_core import is_dead_core
from rollout_engine.episode import EpisodeRunner
from transport.sync_plan import SyncPlan, SyncPlanError

log = logging.getLogger(__name__)

# Why `run()` returned: the gateway shut down; `request_stop` (SIGTERM); the gateway stayed
# unreachable; the gateway dropped the engine; the gateway kept refusing calls.
SHUTDOWN, STOPPED, LOST, DROPPED, ERROR = "shutdown", "stopped", "lost", "dropped", "error"
#: The backend's inference core died (`rollout_engine.dead_core`): the worker stops leasing.
BACKEND_DEAD = "backend dead"
#: Test-only: seconds an engine waits after acking "ready" before it loads a version (a slow
#: engine's load; it keeps serving its old version meanwhile). Unset or 0 in every real run.
LOAD_DELAY_ENV = "JAXRL_TEST_LOAD_DELAY_S"
# At a gateway shutdown, how long a return call already in flight may finish (seconds): the
# gateway may have taken its groups, and `WorkerStats.groups_returned` counts them only then.
SHUTDOWN_RETURN_S = 1.0


@dataclasses.dataclass
class WorkerStats:
    """Counts of one run: groups returned and dropped, prompts released and aborted, syncs."""

    groups_returned: int = 0
    groups_dropped: int = 0
    prompts_released: int = 0
    prompts_aborted: int = 0
    updates: list[UpdateStats] = dataclasses.field(default_factory=list)
    failed_updates: list[tuple[int, str]] = dataclasses.field(default_factory=list)


class EngineWorker:
    """Drives one backend for one gateway (see the module docstring).

    Args:
        client: an engine-role `GatewayClient`.
        backend: a started backend; the worker neither starts nor shuts it down.
        spec: what the engine registers as (its `weight_version` is replaced by the
            backend's).
        cfg: pacing and timeouts.
    """

    def __init__(
        self,
        client: GatewayClient,
        backend: RolloutBackend,
        spec: m.EngineSpec,
        cfg: WorkerConfig | None = None,
    ) -> None:
        self.client = client
        self.backend = backend
        self.spec = spec
        self.cfg = cfg or WorkerConfig()
        self.stats = WorkerStats()
        self.engine_id = ""
        self._call = GatewayCaller(self.cfg.gateway_retry_s)
        self._inflight: dict[asyncio.Task, tuple[str, m.Prompt]] = {}
        self._out: asyncio.Queue = asyncio.Queue()
        self._changed = asyncio.Event()
        self._stop = asyncio.Event()
        self._reason = ""
        self._directive: m.SyncDirective | None = None
        self._directive_event = asyncio.Event()
        self._attempted = (0, "")  # (version, plan group) of the last sync attempted
        self._episodes: EpisodeRunner | None = None
        self._syncing = False
        self._failed = False
        self._group: tuple | None = None  # (generation, transport) of the group joined
        self._loop: asyncio.AbstractEventLoop | None = None
        self.backend_error = ""  # why the backend died, with BACKEND_DEAD

    # ----- public -----
    def request_stop(self, reason: str = STOPPED) -> None:
        """Ask the run to end (thread- and signal-safe): drain, return, deregister."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._end, reason)

    @property
    def leasing(self) -> bool:
        """Whether the worker may lease now (no sync in progress, and the backend not left
        without a whole version by a failed update)."""
        return not (self._syncing or self._failed or self._stop.is_set())

    async def run(self) -> str:
        """Serve until a stop; returns why: "shutdown", "stopped", "lost", "dropped",
        "error" or "backend dead" (see the constants above; `backend_error` then says why).

        Raises:
            RegistrationRefused: the gateway refused the engine (reason inside).
            GatewayLost: the gateway never answered the registration.
        """
        self._loop = asyncio.get_running_loop()
        spec = dataclasses.replace(self.spec, weight_version=self.backend.weight_version or 0)
        reg = await self._call(self.client.register_engine, spec, self.cfg.register_wait_s)
        self.engine_id = reg.engine_id
        log.info("registered as %s (version %d)", reg.engine_id, spec.weight_version)
        beat = HeartbeatThread(
            self.client,
            self.engine_id,
            reg.heartbeat_interval_s,
            active_prompts=lambda: len(self._inflight),
            on_sync=self._offer_threadsafe,
        ).start()
        if reg.sync is not None:
            self._offer(reg.sync)
        tasks = [
            asyncio.create_task(self._lease_loop(), name="lease"),
            asyncio.create_task(self._sync_loop(), name="sync"),
            asyncio.create_task(self._returner(), name="return"),
            asyncio.create_task(self._watch(beat), name="watch"),
        ]
        for task in tasks:
            task.add_done_callback(self._crashed)
        try:
            await self._stop.wait()
        finally:
            await self._teardown(tasks, beat)
        return self._reason

    # ----- state -----
    def _end(self, reason: str) -> None:
        if not self._stop.is_set():
            log.info("stopping: %s", reason)
            self._reason = reason
            self._stop.set()
            self._changed.set()

    def _crashed(self, task: asyncio.Task) -> None:
        """A loop task that dies of an unexpected error ends the run instead of hanging it."""
        if not task.cancelled() and task.exception() is not None:
            log.error("%s task failed", task.get_name(), exc_info=task.exception())
            self._end(ERROR)

    def _offer_threadsafe(self, d: m.SyncDirective) -> None:
        """`_offer` from the heartbeat thread; a directive after the loop closed is moot."""
        try:
            self._loop.call_soon_threadsafe(self._offer, d)  # type: ignore[union-attr]
        except RuntimeError:
            pass

    def _fresh(self, d: m.SyncDirective) -> bool:
        """A directive worth a sync: a version above the one attempted last, or the same
        version on a new data-plane group (the trainer re-planned it after a member died),
        and not a version the backend already holds."""
        held = self.backend.weight_version
        if held is not None and d.target_version <= held:
            return False
        key = (d.target_version, d.params.get("group", ""))
        version, group = self._attempted
        return key[0] > version or (key[0] == version and key[1] != group)

    def _offer(self, d: m.SyncDirective) -> None:
        if not self._fresh(d):
            return
        if self._directive is None or d.target_version >= self._directive.target_version:
            self._directive = d
            self._directive_event.set()

    async def _until_changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    # ----- tasks -----
    async def _lease_loop(self) -> None:
        while not self._stop.is_set():
            room = self.cfg.max_concurrent_prompts - len(self._inflight)
            if not self.leasing or room <= 0:
                await self._until_changed()
                continue
            try:
                lease = await self._call(
                    self.client.lease_prompts,
                    self.engine_id,
                    min(room, self.cfg.lease_batch),
                    self.cfg.lease_wait_s,
                )
            except (GatewayLost, EngineDropped) as e:
                return self._end(LOST if isinstance(e, GatewayLost) else DROPPED)
            except GatewayError as e:
                if self._failed:  # the gateway refuses leases after a failed update: wait
                    continue
                log.error("lease refused: %s", e)
                return self._end(ERROR)
            if lease.sync is not None:
                self._offer(lease.sync)
            if self._failed:  # a poll begun before the update failed: hand its prompts back
                for prompt in lease.prompts:
                    self._out.put_nowait((lease.lease_id, None, prompt.sample_id))
                continue
            for prompt in lease.prompts:
                task = asyncio.create_task(self._serve(lease.lease_id, prompt))
                self._inflight[task] = (lease.lease_id, prompt)
                task.add_done_callback(self._done)
            if lease.shutting_down:
                self._end(SHUTDOWN)

    def _episode_runner(self) -> EpisodeRunner:
        """The runner of multi-turn prompts, made on the first one (the backend's tokenizer).

        Raises:
            ValueError: the backend names no model folder to take a tokenizer from.
        """
        if self._episodes is None:
            path = self.backend.tokenizer_path
            if not path:
                raise ValueError("this backend names no tokenizer, so it cannot play episodes")
            self._episodes = EpisodeRunner(path)
        return self._episodes

    def _done(self, task: asyncio.Task) -> None:
        self._inflight.pop(task, None)
        self._changed.set()

    async def _serve(self, lease_id: str, prompt: m.Prompt) -> None:
        t0 = time.monotonic()
        version = self.backend.weight_version
        try:
            check_prompt(prompt)
            if prompt.episode is not None:
                completions = await self._episode_runner().group(self.backend.generate, prompt)
            else:
                completions = await self.backend.generate(prompt)
            group = group_of(prompt, completions, time.monotonic() - t0)
        except ValueError as e:
            log.warning("prompt %s refused: %s", prompt.sample_id, e)
            self.stats.prompts_aborted += 1
            group = aborted_group(prompt, version or 0)
        except asyncio.CancelledError:
            self._out.put_nowait((lease_id, None, prompt.sample_id))
            raise
        except Exception as e:  # noqa: BLE001 - any backend failure: another engine takes it
            log.error("prompt %s failed (%r); releasing it", prompt.sample_id, e)
            self._out.put_nowait((lease_id, None, prompt.sample_id))
            if is_dead_core(e):
                self._backend_died(e)
            return
        self._out.put_nowait((lease_id, group, prompt.sample_id))

    def _backend_died(self, e: BaseException) -> None:
        """The backend's core is gone: lease nothing more, stop (release, deregister)."""
        if not self._stop.is_set():
            self.backend_error = f"{type(e).__name__}: {e}"[:2000]
            log.error("the backend's inference core is dead (%s): this engine stops leasing, "
                      "releases its prompts and deregisters", self.backend_error)  # fmt: skip
        self._end(BACKEND_DEAD)

    async def _returner(self) -> None:
        """Returns what finished until it takes the `None` sentinel (queued at teardown)."""
        try:
            while True:
                items = [await self._out.get()]
                while not self._out.empty():
                    items.append(self._out.get_nowait())
                last = items[-1] is None
                await self._return([i for i in items if i is not None])
                if last:
                    return
        except (GatewayLost, EngineDropped) as e:
            self._end(LOST if isinstance(e, GatewayLost) else DROPPED)

    async def _return(self, items: list[tuple[str, m.RolloutGroup | None, str]]) -> None:
        by_lease: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
        for lease_id, group, sample_id in items:
            groups, released = by_lease[lease_id]
            (groups.append(group) if group is not None else released.append(sample_id))
        for lease_id, (groups, released) in by_lease.items():
            try:
                r = await self._call(
                    self.client.return_rollouts, self.engine_id, lease_id, groups, released
                )
            except GatewayError as e:
                log.error("returning %d groups of lease %s refused: %s", len(groups), lease_id, e)
                continue
            self.stats.groups_returned += r.accepted
            self.stats.groups_dropped += r.dropped
            self.stats.prompts_released += r.released
            if r.dropped:
                log.warning("gateway dropped %d groups: %s", r.dropped, r.dropped_reason)

    async def _sync_loop(self) -> None:
        while True:
            await self._directive_event.wait()
            self._directive_event.clear()
            d, self._directive = self._directive, None
            if d is None or not self._fresh(d):
                continue
            self._attempted = (d.target_version, d.params.get("group", ""))
            self._syncing = True
            self._changed.set()
            try:
                await self._sync(d)
            except (GatewayLost, EngineDropped) as e:
                return self._end(LOST if isinstance(e, GatewayLost) else DROPPED)
            except GatewayError as e:
                log.error("sync to version %d: the gateway refused an ack: %s", d.target_version, e)
            finally:
                self._syncing = False
                self._changed.set()

    async def _sync(self, d: m.SyncDirective) -> None:
        v = d.target_version
        t0 = time.monotonic()
        try:  # a plan that names no group for this engine fails before "ready"
            plan = SyncPlan.from_params(d.params, v)
            # a mixed plan: a far engine (by its registered name) takes the delta stream
            transport, manifest, rank = plan.leg(self.engine_id, self.spec.name)
        except SyncPlanError as e:
            return await self._failed_update(d, e)
        await self._call(self.client.ack_version, self.engine_id, v, "ready", seq=d.seq)
        try:
            delay_s = float(os.environ.get(LOAD_DELAY_ENV) or 0.0)
            if delay_s > 0:  # a test's slow engine (tests/integration/test_background_push.py)
                await asyncio.sleep(delay_s)
            # the delta stream has one sender for the run: a new plan (group) keeps the stream
            # and the version this engine holds, the base of its next delta
            streamed = transport.get("kind") == "delta_stream"
            group = (-1 if streamed else plan.group, transport)
            if group != self._group:
                self._group = None
                if streamed:  # the sender's records name it
                    transport = {**transport, "name": self.engine_id[:200]}
                await asyncio.wait_for(
                    self.backend.connect_transport(transport, rank, plan.world_size),
                    self.cfg.connect_timeout_s,
                )
                self._group = group
            stats = await asyncio.wait_for(
                self.backend.update_weights(manifest), self.cfg.update_timeout_s
            )
            if self.backend.weight_version != v:
                raise RuntimeError(
                    f"backend reports version {self.backend.weight_version} after loading {v}"
                )
        except (GatewayLost, EngineDropped):
            raise
        except Exception as e:  # noqa: BLE001 - every failure is reported to the gateway
            await self._failed_update(d, e)
            if is_dead_core(e):
                self._backend_died(e)
            return
        self._failed = False
        self.stats.updates.append(stats)
        log.info(
            "loaded version %d in %.2f s; phases %s",
            v, time.monotonic() - t0, json.dumps({k: round(x, 4) for k, x in stats.phases.items()}),
        )  # fmt: skip
        nxt = await self._call(self.client.ack_version, self.engine_id, v, "loaded", seq=d.seq)
        if nxt is not None:
            self._offer(nxt)

    async def _failed_update(self, failed: m.SyncDirective, e: BaseException) -> None:
        """Ack "failed" for the directive's version with the error (`type: message`, at most
        2000 chars), naming its plan (`seq`): the gateway ignores it if the trainer re-planned
        the version meanwhile, so it never counts against the new plan.

        If the backend still holds a whole version, ack with `serving=True` and keep leasing
        for it. If it holds none, ack with `serving=False`, lease nothing until a later
        version loads, and cancel the groups in flight (their prompts go back to the queue).
        """
        v = failed.target_version
        error = f"{type(e).__name__}: {e}"[:2000]
        held = self.backend.weight_version
        serving = held is not None
        if serving:
            log.error("update to version %d failed (still serving %d): %s", v, held, error)
        else:
            log.error("update to version %d failed (no whole version held): %s", v, error)
        self._failed = not serving
        self.stats.failed_updates.append((v, error))
        if not serving:
            for task in list(self._inflight):
                task.cancel()
        d = self._directive
        if d is not None and d.target_version == v and self._fresh(d):
            # the trainer already re-planned this version on a new group (a member of the old
            # one died): this failure is the broken attempt's, not one of the new plan
            log.warning("version %d: not acking the broken attempt; the new plan follows", v)
            return
        await self._call(
            self.client.ack_version, self.engine_id, v, "failed", error, serving=serving,
            seq=failed.seq,
        )  # fmt: skip

    async def _watch(self, beat: HeartbeatThread) -> None:
        failing_since: float | None = None
        while not self._stop.is_set():
            latest, error = beat.latest, beat.error
            if latest is not None and latest.shutting_down:
                self._end(SHUTDOWN)
            elif error is not None and getattr(error, "code", None) == NOT_FOUND:
                self._end(DROPPED)
            elif error is not None:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self.cfg.gateway_retry_s:
                    self._end(LOST)
            else:
                failing_since = None
            await asyncio.sleep(self.cfg.watch_interval_s)

    # ----- stop -----
    async def _teardown(self, tasks: list[asyncio.Task], beat: HeartbeatThread) -> None:
        """End the tasks; on a stop, return what finished and deregister; at a gateway
        shutdown, let a return call already in flight finish (`SHUTDOWN_RETURN_S`). Bounded
        by `WorkerConfig.stop_s` whatever the gateway's state: an unreachable gateway is not
        retried past it (each call left running ends when the client's channel closes)."""
        end = time.monotonic() + self.cfg.stop_s
        lease_loop, sync_loop, returner, watch = tasks
        for t in (lease_loop, sync_loop, watch):
            t.cancel()
        # a gateway the heartbeat cannot reach now is not waited for (it is gone or hung)
        reachable = self._reason in (STOPPED, BACKEND_DEAD) and beat.error is None
        if reachable and self._inflight:
            drain = min(self.cfg.drain_s, end - time.monotonic() - 1.0)
            if drain > 0:
                await asyncio.wait(list(self._inflight), timeout=drain)
        pending = list(self._inflight)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, lease_loop, sync_loop, watch, return_exceptions=True)
        # the returner ends after what it holds: on a stop, every group that finished; at a
        # gateway shutdown, the return call in flight (the gateway may have taken its groups)
        if reachable or self._reason == SHUTDOWN:
            left = end - time.monotonic()
            self._out.put_nowait(None)
            limit = left - 0.5 if reachable else min(SHUTDOWN_RETURN_S, left)
            await asyncio.wait([returner], timeout=max(0.0, limit))
        if reachable:  # then leave (leased prompts go back to the queue)
            try:
                back = await asyncio.wait_for(
                    self._call(self.client.deregister, self.engine_id),
                    max(0.1, end - time.monotonic()),
                )
                log.info("deregistered; %d leased prompts went back to the queue", back)
            except (TimeoutError, GatewayError, GatewayLost, EngineDropped) as e:
                log.warning("deregistering failed within the stop (stop_s): %r", e)
        elif self._reason == STOPPED:
            log.warning("stopping without deregistering: the gateway does not answer (%s)",
                        beat.error)  # fmt: skip
        returner.cancel()
        await asyncio.gather(returner, return_exceptions=True)
        beat.stop(timeout_s=0.1)  # a daemon thread; its long poll ends when the channel closes
        self._call.close()
