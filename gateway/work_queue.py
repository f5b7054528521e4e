"""The prompt work queue: pending prompts, leases, and the bounded queue of finished groups.

A prompt is in exactly one place until the trainer fetches its group: pending (eval or train
queue), leased (inside one lease), or ready (its group waits for the trainer). An expired
lease puts its unfinished prompts back at the front of their queue, in order; a group
returned for such a lease is dropped, so no group reaches the trainer twice.

Not thread-safe: `gateway.state.GatewayState` calls it under its lock.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets

from gateway.errors import ALREADY_EXISTS, NOT_FOUND, GatewayError, invalid
from gateway.validate import check_group
from protos import rollout_pb2 as rpb

_REMEMBERED_LEASES = 100_000  # closed lease ids kept to explain late returns


@dataclasses.dataclass
class _Entry:
    prompt: rpb.Prompt
    submitted_at: float
    leased_at: float = 0.0
    lease_id: str = ""


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
    """What happened to a ReturnRollouts call: groups accepted, dropped (and why), released."""

    accepted: int = 0
    dropped: int = 0
    dropped_reason: str = ""
    released: int = 0
    completions: int = 0
    tokens: int = 0


class WorkQueue:
    """Pending prompts, leases and ready groups; see the module docstring for the invariant."""

    def __init__(self, max_pending: int, rollout_capacity: int) -> None:
        self.max_pending = max_pending
        self.rollout_capacity = rollout_capacity
        self._boot = secrets.token_hex(3)
        self._next_lease = 0
        self._entries: dict[str, _Entry] = {}
        self._pending: dict[bool, collections.deque[str]] = {
            True: collections.deque(),
            False: collections.deque(),
        }
        self._ready: collections.deque[rpb.RolloutGroup] = collections.deque()
        self.leases: dict[str, Lease] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.leased_prompts = 0
        self.counters: collections.Counter[str] = collections.Counter()

    # ----- depths -----
    def pending(self, is_eval: bool) -> int:
        """Prompts waiting in the eval (True) or train (False) queue."""
        return len(self._pending[is_eval])

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
                    f"sample id {p.sample_id!r}: expected an id not in flight, got one that "
                    "is already pending, leased, waiting to be fetched, or repeated",
                )
            seen.add(p.sample_id)

    def submit(self, prompts: list[rpb.Prompt], now: float) -> None:
        """Append checked prompts (see `check_new`) to the back of their queues."""
        for p in prompts:
            self._entries[p.sample_id] = _Entry(p, now)
            self._pending[p.is_eval].append(p.sample_id)
        self.counters["prompts_submitted"] += len(prompts)

    def fetch(self, max_groups: int) -> list[rpb.RolloutGroup]:
        """Pop up to `max_groups` ready groups, oldest first; their prompts leave the queue."""
        out: list[rpb.RolloutGroup] = []
        while self._ready and len(out) < max_groups:
            group = self._ready.popleft()
            del self._entries[group.sample_id]
            out.append(group)
        self.counters["groups_fetched"] += len(out)
        return out

    # ----- engine side -----
    def lease(
        self, engine_id: str, max_prompts: int, engine_version: int, now: float, seconds: float
    ) -> Lease | None:
        """Lease up to `max_prompts` prompts (eval first) that `engine_version` may serve.

        A queue is read from its front and stops at the first prompt whose `min_version`
        exceeds `engine_version`. Returns None when nothing could be leased.
        """
        n = min(max_prompts, self.room())
        taken: dict[str, None] = {}
        for is_eval in (True, False):
            queue = self._pending[is_eval]
            while queue and len(taken) < n:
                entry = self._entries[queue[0]]
                if entry.prompt.min_version > engine_version:
                    break
                queue.popleft()
                taken[entry.prompt.sample_id] = None
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
        eligible = any(
            q and self._entries[q[0]].prompt.min_version <= engine_version
            for q in self._pending.values()
        )
        return eligible, self.room() > 0

    def complete(
        self,
        engine_id: str,
        lease_id: str,
        groups: list[rpb.RolloutGroup],
        released: list[str],
        now: float,
        current_version: int,
    ) -> ReturnOutcome:
        """Accept finished groups of a lease and give back released prompts.

        Checks everything before changing anything. A lease that expired or completed drops
        the groups (counted in the outcome); an unknown lease, a lease of another engine, a
        sample id outside the lease, a repeated sample id, or a malformed group raises
        `GatewayError` and changes nothing.
        """
        lease = self.leases.get(lease_id)
        if lease is None:
            if lease_id in self._closed:
                self.counters["groups_dropped_late"] += len(groups)
                return ReturnOutcome(dropped=len(groups), dropped_reason=self._closed[lease_id])
            raise GatewayError(
                NOT_FOUND,
                f"lease id {lease_id!r}: expected a lease the gateway granted, got an unknown id",
            )
        if lease.engine_id != engine_id:
            raise invalid(
                f"lease {lease_id!r}: expected its holder {lease.engine_id!r}, "
                f"got engine {engine_id!r}"
            )
        seen: set[str] = set()
        for sid in [g.sample_id for g in groups] + list(released):
            if sid in seen:
                raise invalid(f"sample id {sid!r}: expected once per return, got it twice")
            seen.add(sid)
            if sid not in self._entries or self._entries[sid].lease_id != lease_id:
                raise invalid(
                    f"sample id {sid!r}: expected a prompt of lease {lease_id!r}, "
                    "got one outside it"
                )
        for g in groups:
            check_group(g, self._entries[g.sample_id].prompt, current_version)
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
        self._requeue(list(released), lease)
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

    def _requeue(self, sample_ids: list[str], lease: Lease) -> None:
        for sid in reversed(sample_ids):
            entry = self._entries[sid]
            entry.lease_id = ""
            lease.outstanding.pop(sid, None)
            self._pending[entry.prompt.is_eval].appendleft(sid)

    def _close(self, lease: Lease, reason: str) -> None:
        del self.leases[lease.lease_id]
        self._closed[lease.lease_id] = reason
        while len(self._closed) > _REMEMBERED_LEASES:
            self._closed.popitem(last=False)
