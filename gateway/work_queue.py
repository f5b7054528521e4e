"""The prompt work queue: pending prompts, leases, and the bounded queue of finished groups.

A prompt is in exactly one place until the trainer fetches its group: pending (eval or train
queue), leased (inside one lease), or ready (its group waits for the trainer). An expired
lease puts its unfinished prompts back at the front of their queue, in order; a group
returned for such a lease is dropped, so no group reaches the trainer twice.

Each queue is kept as one deque per `min_version`, each sorted by a sequence number (new
prompts get increasing ones at the back, requeued prompts decreasing ones at the front), and
a lease takes the lowest sequence number among the deques the engine's version may serve: the
order of a single queue, except that a prompt waiting for a newer version never blocks the
prompts behind it. Replies stay under a byte budget: a lease or fetch stops before the prompt
or group that would pass it (but always hands out at least one).

Not thread-safe: `gateway.state.GatewayState` calls it under its lock.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets

from gateway.errors import ALREADY_EXISTS, NOT_FOUND, GatewayError, invalid, shown
from gateway.validate import check_group
from protos import rollout_pb2 as rpb

_REMEMBERED_LEASES = 100_000  # closed lease ids kept to explain late returns


@dataclasses.dataclass
class _Entry:
    prompt: rpb.Prompt
    submitted_at: float
    leased_at: float = 0.0
    lease_id: str = ""
    seq: int = 0  # order within the pending queues (lower: nearer the front)
    releases: int = 0  # times an engine gave it back unserved


@dataclasses.dataclass
class Lease:
    """Prompts handed to one engine until `deadline` (clock seconds).

    Attributes:
        lease_id: unique id.
        engine_id: the engine holding it.
        outstanding: sample ids not yet returned or released (insertion-ordered).
        granted_at, deadline: clock seconds.
    """

    lease_id: str
    engine_id: str
    outstanding: dict[str, None]
    granted_at: float
    deadline: float


@dataclasses.dataclass
class ReturnOutcome:
    """What happened to a ReturnRollouts call: groups accepted, dropped (and why), released,
    and the released prompts given up on (`abandoned`: sample ids, now aborted groups)."""

    accepted: int = 0
    dropped: int = 0
    dropped_reason: str = ""
    released: int = 0
    completions: int = 0
    tokens: int = 0
    abandoned: list[str] = dataclasses.field(default_factory=list)


class WorkQueue:
    """Pending prompts, leases and ready groups; see the module docstring for the invariant."""

    def __init__(self, max_pending: int, rollout_capacity: int, max_releases: int = 5) -> None:
        self.max_pending = max_pending
        self.rollout_capacity = rollout_capacity
        self.max_releases = max_releases
        self._boot = secrets.token_hex(3)
        self._next_lease = 0
        self._entries: dict[str, _Entry] = {}
        # is_eval -> min_version -> sample ids in sequence order (no empty deques kept)
        self._pending: dict[bool, dict[int, collections.deque[str]]] = {True: {}, False: {}}
        self._count = {True: 0, False: 0}
        self._back = 0  # next sequence number at the back
        self._front = -1  # next sequence number at the front
        self._ready: collections.deque[rpb.RolloutGroup] = collections.deque()
        self.leases: dict[str, Lease] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.leased_prompts = 0
        self.counters: collections.Counter[str] = collections.Counter()

    # ----- depths -----
    def pending(self, is_eval: bool) -> int:
        """Prompts waiting in the eval (True) or train (False) queue."""
        return self._count[is_eval]

    @property
    def ready(self) -> int:
        """Groups waiting for the trainer."""
        return len(self._ready)

    def room(self) -> int:
        """Prompts that may still be leased before the rollout capacity is reached."""
        return self.rollout_capacity - self.ready - self.leased_prompts

    def in_flight(self, sample_id: str) -> bool:
        """Whether a prompt with this id is pending, leased or ready."""
        return sample_id in self._entries

    # ----- trainer side -----
    def check_new(self, prompts: list[rpb.Prompt]) -> None:
        """Raise ALREADY_EXISTS for an id repeated in `prompts` or already in flight."""
        seen: set[str] = set()
        for p in prompts:
            if p.sample_id in seen or p.sample_id in self._entries:
                raise GatewayError(
                    ALREADY_EXISTS,
                    f"sample id {shown(p.sample_id)}: expected an id not in flight, got one that "
                    "is already pending, leased, waiting to be fetched, or repeated",
                )
            seen.add(p.sample_id)

    def submit(self, prompts: list[rpb.Prompt], now: float) -> None:
        """Append checked prompts (see `check_new`) to the back of their queues."""
        for p in prompts:
            self._entries[p.sample_id] = _Entry(p, now, seq=self._back)
            self._back += 1
            self._pending[p.is_eval].setdefault(p.min_version, collections.deque()).append(
                p.sample_id
            )
            self._count[p.is_eval] += 1
        self.counters["prompts_submitted"] += len(prompts)

    def fetch(self, max_groups: int, max_bytes: int = 1 << 62) -> list[rpb.RolloutGroup]:
        """Pop up to `max_groups` ready groups, oldest first, stopping before the group that
        would bring the serialized total past `max_bytes` (at least one is popped); their
        prompts leave the queue."""
        out: list[rpb.RolloutGroup] = []
        size = 0
        while self._ready and len(out) < max_groups:
            size += self._ready[0].ByteSize()
            if out and size > max_bytes:
                break
            group = self._ready.popleft()
            del self._entries[group.sample_id]
            out.append(group)
        self.counters["groups_fetched"] += len(out)
        return out

    # ----- engine side -----
    def lease(
        self,
        engine_id: str,
        max_prompts: int,
        engine_version: int,
        now: float,
        seconds: float,
        max_bytes: int = 1 << 62,
    ) -> Lease | None:
        """Lease up to `max_prompts` prompts (eval first) that `engine_version` may serve.

        Prompts are taken in queue order, skipping (not stopping at) those whose
        `min_version` exceeds `engine_version`, and stopping before the prompt that would
        bring the serialized total past `max_bytes` (at least one is taken). Returns None
        when nothing could be leased.
        """
        n = min(max_prompts, self.room())
        taken: dict[str, None] = {}
        size = 0
        for is_eval in (True, False):
            by_version = self._pending[is_eval]
            while len(taken) < n:
                heads = [
                    (self._entries[q[0]].seq, v)
                    for v, q in by_version.items()
                    if v <= engine_version
                ]
                if not heads:
                    break
                version = min(heads)[1]
                queue = by_version[version]
                size += self._entries[queue[0]].prompt.ByteSize()
                if taken and size > max_bytes:
                    n = len(taken)
                    break
                taken[queue.popleft()] = None
                self._count[is_eval] -= 1
                if not queue:
                    del by_version[version]
        if not taken:
            return None
        self._next_lease += 1
        lease = Lease(f"L{self._boot}-{self._next_lease}", engine_id, taken, now, now + seconds)
        for sid in taken:
            self._entries[sid].leased_at = now
            self._entries[sid].lease_id = lease.lease_id
        self.leases[lease.lease_id] = lease
        self.leased_prompts += len(taken)
        self.counters["prompts_leased"] += len(taken)
        return lease

    def prompts_of(self, lease: Lease) -> list[rpb.Prompt]:
        """The prompts of a lease, in lease order."""
        return [self._entries[sid].prompt for sid in lease.outstanding]

    def could_lease(self, engine_version: int) -> tuple[bool, bool]:
        """(a prompt is eligible for `engine_version`, the rollout capacity has room)."""
        eligible = any(v <= engine_version for q in self._pending.values() for v in q)
        return eligible, self.room() > 0

    def complete(
        self,
        engine_id: str,
        lease_id: str,
        groups: list[rpb.RolloutGroup],
        released: list[str],
        now: float,
        current_version: int,
        max_group_bytes: int = 1 << 62,
    ) -> ReturnOutcome:
        """Accept finished groups of a lease and give back released prompts.

        Checks everything before changing anything. A lease that expired or completed drops
        the groups (counted in the outcome); an unknown lease, a lease of another engine, a
        sample id outside the lease, a repeated sample id, a malformed group, or a group
        that with its prompt would pass `max_group_bytes` (it could never be fetched) raises
        `GatewayError` and changes nothing.
        """
        lease = self.leases.get(lease_id)
        if lease is None:
            if lease_id in self._closed:
                self.counters["groups_dropped_late"] += len(groups)
                return ReturnOutcome(dropped=len(groups), dropped_reason=self._closed[lease_id])
            raise GatewayError(
                NOT_FOUND,
                f"lease id {shown(lease_id)}: expected a lease the gateway granted, got an "
                "unknown id",
            )
        if lease.engine_id != engine_id:
            raise invalid(
                f"lease {shown(lease_id)}: expected its holder {shown(lease.engine_id)}, "
                f"got engine {shown(engine_id)}"
            )
        seen: set[str] = set()
        for sid in [g.sample_id for g in groups] + list(released):
            if sid in seen:
                raise invalid(f"sample id {shown(sid)}: expected once per return, got it twice")
            seen.add(sid)
            if sid not in self._entries or self._entries[sid].lease_id != lease_id:
                raise invalid(
                    f"sample id {shown(sid)}: expected a prompt of lease {shown(lease_id)}, "
                    "got one outside it"
                )
        for g in groups:
            prompt = self._entries[g.sample_id].prompt
            check_group(g, prompt, current_version)
            size = g.ByteSize() + prompt.ByteSize()
            if size > max_group_bytes:
                raise invalid(
                    f"group {shown(g.sample_id)}: expected at most {max_group_bytes} bytes "
                    f"with its prompt (half the largest message), got {size}"
                )
        out = ReturnOutcome()
        for g in groups:
            entry = self._entries[g.sample_id]
            g.engine_id = engine_id
            g.prompt.CopyFrom(entry.prompt)
            g.queue_s = entry.leased_at - entry.submitted_at
            g.lease_s = now - entry.leased_at
            entry.lease_id = ""
            del lease.outstanding[g.sample_id]
            self._ready.append(g)
            out.accepted += 1
            out.completions += len(g.completions)
            out.tokens += sum(len(c.token_ids) for c in g.completions)
        out.abandoned = self._give_back(list(released), lease, engine_id, now, current_version)
        out.released = len(released)
        self.leased_prompts -= out.accepted + out.released
        self.counters["groups_returned"] += out.accepted
        self.counters["prompts_released"] += out.released
        if not lease.outstanding:
            self._close(lease, f"lease {lease_id!r} was already completed")
        return out

    def expire(self, lease: Lease, reason: str) -> int:
        """Close a lease; its outstanding prompts go back to the front. Returns their count."""
        n = len(lease.outstanding)
        self._requeue(list(lease.outstanding), lease)
        self.leased_prompts -= n
        self.counters["leases_expired"] += 1
        self._close(lease, reason)
        return n

    def _give_back(
        self, sample_ids: list[str], lease: Lease, engine_id: str, now: float, version: int
    ) -> list[str]:
        """Prompts an engine released unserved: back to the front of their queue, except
        those given back `max_releases` times, which become aborted groups for the trainer
        (see `GatewayConfig.max_prompt_releases`). Returns the sample ids given up on."""
        again, abandoned = [], []
        for sid in sample_ids:
            entry = self._entries[sid]
            entry.releases += 1
            if entry.releases < self.max_releases:
                again.append(sid)
                continue
            lease.outstanding.pop(sid, None)
            entry.lease_id = ""
            p = entry.prompt
            empty = rpb.Completion(finish_reason=rpb.FINISH_REASON_ABORT, version_start=version,
                                   version_end=version)  # fmt: skip
            group = rpb.RolloutGroup(sample_id=sid, engine_id=engine_id, prompt=p,
                                     completions=[empty] * p.group_size)  # fmt: skip
            group.queue_s = entry.leased_at - entry.submitted_at
            group.lease_s = now - entry.leased_at
            self._ready.append(group)
            self.counters["prompts_abandoned"] += 1
            abandoned.append(sid)
        self._requeue(again, lease)
        return abandoned

    def _requeue(self, sample_ids: list[str], lease: Lease) -> None:
        for sid in reversed(sample_ids):
            entry = self._entries[sid]
            entry.lease_id = ""
            entry.seq = self._front
            self._front -= 1
            lease.outstanding.pop(sid, None)
            p = entry.prompt
            self._pending[p.is_eval].setdefault(p.min_version, collections.deque()).appendleft(sid)
            self._count[p.is_eval] += 1

    def _close(self, lease: Lease, reason: str) -> None:
        del self.leases[lease.lease_id]
        self._closed[lease.lease_id] = reason
        while len(self._closed) > _REMEMBERED_LEASES:
            self._closed.popitem(last=False)
