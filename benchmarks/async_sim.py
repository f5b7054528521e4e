"""Async against sync, simulated: the real `gateway.work_queue.WorkQueue` driven in virtual time.

A discrete-event simulation (a heap of (virtual seconds, sequence number, event); nothing
sleeps) of the loop of `trainer.loop.AsyncTrainer` against E engines, for rollout.max_lag 0
(sync: prompts carry ``min_version`` = the trainer's version and only the current update's are
in flight, so engines wait for the new version and the trainer for a full batch) and 1, 2
(``(max_lag) * P`` prompts kept submitted ahead). Prompts, leases, returns and fetches go
through the gateway's own queue with real `protos.rollout_pb2` messages, checked by its
`complete` (`gateway.validate.check_group`) as on the wire.

The model (stated, not measured):
- trainer: one update takes groups in arrival order, tops up before each one exactly as
  `AsyncTrainer._collect` (in flight = P - kept + ahead + taken), drops a group whose lag
  (trainer version - oldest ``version_start``) exceeds max_lag, and after P kept trains for
  `step_s` then pushes for `sync_s` (blocking, as `publisher.push`); idle = the collecting time.
- engine: holds up to `slots` prompt groups at once (launch.max_concurrent_prompts); a group's G
  completions decode side by side, one token each per `token_s` seconds whatever the occupancy
  (a memory-bound decode step), so a group takes ``overhead_s + token_s * max(lengths)``
  (overhead: prefill and round trips, measured as one constant). A push pauses every engine for
  `sync_s` (in-flight groups finish `sync_s` later, with ``version_end`` the new version); it
  leases again (its new version) when the pause ends. Engine idle: time with no group in flight;
  slot idle: unused slot-seconds.
- rates count the updates after `warmup` (steady state): steps per hour, idle fractions and
  the lag of each trained group.

Anchors printed beside the speedups are other systems' published figures, not reproduced
here: PipelineRL about 2x (Piché et al. 2025, "PipelineRL"), verl 2.35-2.67x (verl's
one-step-off-policy / fully async recipes), AReaL up to 2.77x (Fu et al. 2025, "AReaL").

Run: ``python benchmarks/async_sim.py`` (defaults from one run of
``benchmarks/async_vs_sync.py``; ``--measured FILE`` reads that script's output instead).
Prints a table and, as the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

from gateway.work_queue import WorkQueue
from protos import rollout_pb2 as rpb

# From one run of benchmarks/async_vs_sync.py on this 2-core machine (engine on core 0,
# trainer on core 1, tiny smoke model, P=4 prompts x G=4): see `defaults_from_measured`.
MEASURED = {"token_s": 0.0018, "overhead_s": 0.034, "step_s": 0.14, "sync_s": 0.053, "rows": 16}
ANCHORS = {
    "PipelineRL": "about 2x",
    "verl (async / one-step off-policy)": "2.35-2.67x",
    "AReaL": "up to 2.77x",
}
TAILS = ("fixed", "uniform", "tail10x8", "lognormal")

LengthSampler = Callable[[random.Random], list[int]]


def length_sampler(tail: str, base: int, group_size: int) -> LengthSampler:
    """The completion lengths (tokens, G ints >= 1) of one group for a length tail.

    fixed: all `base`; uniform: each uniform in [1, 2*base - 1] (mean base); tail10x8: one
    prompt in ten asks 8*base (all its G completions), the rest base; lognormal: each
    ``round(base * exp(N(0, 1)))`` (median base), clipped to [1, 16*base].

    Raises:
        ValueError: an unknown tail, base < 1 or group_size < 1.
    """
    if base < 1 or group_size < 1:
        raise ValueError(f"base and group_size must be >= 1; got {base}, {group_size}")
    g = group_size
    if tail == "fixed":
        return lambda rng: [base] * g
    if tail == "uniform":
        return lambda rng: [rng.randint(1, 2 * base - 1) for _ in range(g)]
    if tail == "tail10x8":
        return lambda rng: [8 * base if rng.random() < 0.1 else base] * g
    if tail == "lognormal":
        cap = 16 * base
        return lambda rng: [
            min(cap, max(1, round(base * math.exp(rng.gauss(0.0, 1.0))))) for _ in range(g)
        ]
    raise ValueError(f"tail: expected one of {TAILS}, got {tail!r}")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """One simulated run (seconds are virtual).

    Attributes:
        engines: E >= 1. max_lag: rollout.max_lag (>= 0; queue_steps = max_lag + 1).
        prompts_per_step: P, groups kept per update. group_size: G completions per prompt.
        slots: groups one engine decodes at once. token_s: seconds per decode step.
        step_s: trainer seconds per train step. sync_s: seconds per weight push.
        steps: updates simulated; warmup: leading updates left out of the rates (< steps).
        max_new_tokens: the prompts' cap (>= every sampled length). seed: the length draws.
        overhead_s: seconds a group takes beyond its decode steps (prefill, round trips).
    """

    engines: int
    max_lag: int
    prompts_per_step: int
    group_size: int
    slots: int
    token_s: float
    step_s: float
    sync_s: float
    steps: int
    warmup: int = 1
    max_new_tokens: int = 1 << 16
    seed: int = 0
    overhead_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Steady-state figures of a run (updates after the warm-up).

    Attributes:
        steps_per_hour: updates per virtual hour. seconds_per_step: its inverse x 3600.
        trainer_idle_fraction: collecting time / window. engine_idle_fraction: mean over
        engines of time with no group in flight / window. slot_idle_fraction: unused
        slot-seconds / (E * slots * window). lag_counts: trained groups by lag.
        dropped_lag: groups dropped for a lag above max_lag.
    """

    steps_per_hour: float
    seconds_per_step: float
    trainer_idle_fraction: float
    engine_idle_fraction: float
    slot_idle_fraction: float
    lag_counts: dict[int, int]
    dropped_lag: int


@dataclasses.dataclass
class _Engine:
    engine_id: str
    version: int = 0
    paused_until: float = 0.0
    epoch: int = 0  # bumped by a pause: older finish events are stale
    # sample id -> (lease id, finish time, lengths, version_start)
    active: dict[str, tuple[str, float, list[int], int]] = dataclasses.field(default_factory=dict)
    changed_at: float = 0.0
    busy_s: float = 0.0  # integral of (a group in flight)
    slot_s: float = 0.0  # integral of the groups in flight

    def account(self, now: float) -> None:
        dt = now - self.changed_at
        self.busy_s += dt if self.active else 0.0
        self.slot_s += dt * len(self.active)
        self.changed_at = now


class Simulation:
    """One run of `SimConfig` with a length sampler; `run()` returns its `SimResult`.

    Raises (from `run`): RuntimeError when events run out before `steps` updates (a model
    that cannot progress); the queue's `GatewayError` on a malformed message (a bug here).
    """

    def __init__(self, cfg: SimConfig, lengths: LengthSampler) -> None:
        if not 0 <= cfg.warmup < cfg.steps:
            raise ValueError(f"need 0 <= warmup < steps; got {cfg.warmup}, {cfg.steps}")
        self.cfg, self.lengths = cfg, lengths
        self.rng = random.Random(cfg.seed)
        self.queue = WorkQueue(max_pending=1 << 30, rollout_capacity=1 << 30)
        self.engines = [_Engine(f"e{i}") for i in range(cfg.engines)]
        self.now = 0.0
        self._heap: list[tuple[float, int, str, tuple]] = []
        self._seq = 0
        self.version = 0  # the trainer's (and the gateway's current) version
        self.done = 0
        self.submitted = self.consumed = 0
        self.ahead = cfg.max_lag * cfg.prompts_per_step
        self.collecting = False
        self.collect_start = 0.0
        self.wait_s = 0.0
        self.kept: list[rpb.RolloutGroup] = []
        self.taken = 0
        self.lag_counts: collections.Counter[int] = collections.Counter()
        self.dropped_lag = 0
        self._mark: tuple[float, float, float, float] | None = None

    # ----- events -----
    def _at(self, t: float, kind: str, *args: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, args))

    def run(self) -> SimResult:
        """Simulate `steps` updates; see the module docstring for the model."""
        self._start_update()
        while self.done < self.cfg.steps:
            if not self._heap:
                raise RuntimeError(f"no event left after {self.done} updates")
            self.now, _, kind, args = heapq.heappop(self._heap)
            getattr(self, f"_on_{kind}")(*args)
        return self._result()

    # ----- trainer -----
    def _start_update(self) -> None:
        self.collecting, self.collect_start = True, self.now
        self.kept, self.taken = [], 0
        self._take()

    def _top_up(self) -> None:
        p = self.cfg.prompts_per_step
        need = p - len(self.kept) + self.ahead + self.taken
        missing = need - (self.submitted - self.consumed)
        if missing <= 0:
            return
        sampling = rpb.SamplingParams(
            temperature=1.0, top_p=1.0, max_new_tokens=self.cfg.max_new_tokens
        )
        prompts = [
            rpb.Prompt(
                sample_id=f"s{self.submitted + i}",
                token_ids=[1, 2, 3],
                group_size=self.cfg.group_size,
                sampling=sampling,
                min_version=self.version,
            )
            for i in range(missing)
        ]
        self.queue.check_new(prompts)
        self.queue.submit(prompts, self.now)
        self.submitted += missing
        for e in self.engines:
            self._lease(e)

    def _take(self) -> None:
        """Collect (`AsyncTrainer._collect`): top up, take a ready group, until P are kept."""
        p = self.cfg.prompts_per_step
        while True:
            self._top_up()
            if not self.queue.ready:
                return
            group = self.queue.fetch(1)[0]
            self.taken += 1
            lag = self.version - min(c.version_start for c in group.completions)
            counted = self.done >= self.cfg.warmup  # the update under way is past warm-up
            if lag > self.cfg.max_lag:
                self.dropped_lag += counted
            else:
                self.kept.append(group)
                if counted:
                    self.lag_counts[lag] += 1
            if len(self.kept) == p:
                break
        self.collecting = False
        self.wait_s += self.now - self.collect_start
        self._at(self.now + self.cfg.step_s, "trained")

    def _on_trained(self) -> None:
        end = self.now + self.cfg.sync_s
        for e in self.engines:
            e.paused_until = end
            if self.cfg.sync_s > 0 and e.active:
                e.epoch += 1
                for sid, (lease_id, finish, lengths, v0) in list(e.active.items()):
                    e.active[sid] = (lease_id, finish + self.cfg.sync_s, lengths, v0)
                    self._at(finish + self.cfg.sync_s, "group_done", e, sid, e.epoch)
        self._at(end, "synced")

    def _on_synced(self) -> None:
        self.version += 1
        self.consumed += self.taken
        self.done += 1
        for e in self.engines:
            e.version = self.version
        if self.done == self.cfg.warmup:
            self._mark = self._integrals()
        if self.done == self.cfg.steps:
            return
        for e in self.engines:
            self._lease(e)
        self._start_update()

    # ----- engines -----
    def _lease(self, e: _Engine) -> None:
        free = self.cfg.slots - len(e.active)
        if free <= 0 or self.now < e.paused_until:
            return
        lease = self.queue.lease(e.engine_id, free, e.version, self.now, 1e12)
        if lease is None:
            return
        e.account(self.now)
        for prompt in self.queue.prompts_of(lease):
            lengths = self.lengths(self.rng)
            finish = self.now + self.cfg.overhead_s + self.cfg.token_s * max(lengths)
            e.active[prompt.sample_id] = (lease.lease_id, finish, lengths, e.version)
            self._at(finish, "group_done", e, prompt.sample_id, e.epoch)

    def _on_group_done(self, e: _Engine, sid: str, epoch: int) -> None:
        if epoch != e.epoch or sid not in e.active:
            return
        e.account(self.now)
        lease_id, _, lengths, v0 = e.active.pop(sid)
        completions = [
            rpb.Completion(token_ids=[7] * n, logprobs=[-0.5] * n, version_start=v0,
                           version_end=e.version, finish_reason=rpb.FINISH_REASON_LENGTH)
            for n in lengths
        ]  # fmt: skip
        group = rpb.RolloutGroup(sample_id=sid, completions=completions)
        self.queue.complete(e.engine_id, lease_id, [group], [], self.now, self.version)
        self._lease(e)
        if self.collecting:
            self._take()

    # ----- figures -----
    def _integrals(self) -> tuple[float, float, float, float]:
        for e in self.engines:
            e.account(self.now)
        busy = sum(e.busy_s for e in self.engines)
        slots = sum(e.slot_s for e in self.engines)
        return self.now, self.wait_s, busy, slots

    def _result(self) -> SimResult:
        t0, w0, b0, s0 = self._mark or (0.0, 0.0, 0.0, 0.0)
        t1, w1, b1, s1 = self._integrals()
        window, n = t1 - t0, self.cfg.steps - self.cfg.warmup
        e = self.cfg.engines
        return SimResult(
            steps_per_hour=3600.0 * n / window,
            seconds_per_step=window / n,
            trainer_idle_fraction=(w1 - w0) / window,
            engine_idle_fraction=1.0 - (b1 - b0) / (e * window),
            slot_idle_fraction=1.0 - (s1 - s0) / (e * self.cfg.slots * window),
            lag_counts=dict(sorted(self.lag_counts.items())),
            dropped_lag=self.dropped_lag,
        )


def simulate(cfg: SimConfig, tail: str = "fixed", base_len: int = 16) -> SimResult:
    """Run `cfg` with the completion lengths of `tail` around `base_len` tokens
    (`length_sampler`). Raises as `length_sampler` and `Simulation.run`."""
    return Simulation(cfg, length_sampler(tail, base_len, cfg.group_size)).run()


def defaults_from_measured(path: Path | None) -> dict[str, float]:
    """token_s, overhead_s, step_s, sync_s and rows (P*G of the measured run) from the last
    JSON line of ``benchmarks/async_vs_sync.py`` output at `path` (its "sim_inputs"), else
    `MEASURED`.

    Raises:
        KeyError: the line has no "sim_inputs"; ValueError: it is not JSON.
    """
    if path is None:
        return dict(MEASURED)
    last = path.read_text().strip().splitlines()[-1]
    inputs = json.loads(last)["sim_inputs"]
    return {k: float(inputs[k]) for k in MEASURED}


def main() -> None:
    """Sweep engines x tails x max_lag; print a table and the JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", type=Path, help="async_vs_sync.py output to take inputs from")
    ap.add_argument("--engines", default="1,2,4,8,16,32,64")
    ap.add_argument("--tails", default=",".join(TAILS))
    ap.add_argument("--lags", default="0,1,2")
    ap.add_argument("--prompts-per-step", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--base-len", type=int, default=128, help="tokens of a short completion")
    ap.add_argument("--token-s", type=float, help="default: measured")
    ap.add_argument("--step-s", type=float, help="default: measured, scaled to P*G rows")
    ap.add_argument("--sync-s", type=float, help="default: measured")
    ap.add_argument("--overhead-s", type=float, help="default: measured")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    m = defaults_from_measured(a.measured)
    rows = a.prompts_per_step * a.group_size
    token_s = m["token_s"] if a.token_s is None else a.token_s
    step_s = m["step_s"] * rows / m["rows"] if a.step_s is None else a.step_s
    sync_s = m["sync_s"] if a.sync_s is None else a.sync_s
    overhead_s = m["overhead_s"] if a.overhead_s is None else a.overhead_s
    engines = [int(x) for x in a.engines.split(",")]
    tails, lags = a.tails.split(","), [int(x) for x in a.lags.split(",")]
    print(f"inputs: token_s={token_s:.4g} s/decode step, step_s={step_s:.4g} s/update "
          f"(measured {m['step_s']:.4g} s for {m['rows']:.0f} rows, scaled linearly to {rows}), "
          f"sync_s={sync_s:.4g} s, overhead_s={overhead_s:.4g} s/group, "
          f"P={a.prompts_per_step}, G={a.group_size}, "
          f"slots={a.slots}/engine, short length {a.base_len} tokens, {a.steps} updates "
          f"({a.warmup} warm-up); source: {a.measured or 'MEASURED in this file'}")  # fmt: skip
    print(f"{'tail':>9} {'E':>3} {'lag':>3} {'steps/h':>9} {'s/step':>7} {'tr_idle':>7} "
          f"{'en_idle':>7} {'slot_idle':>9} {'dropped':>7}  lags")  # fmt: skip
    table: dict[str, dict[int, dict[int, dict]]] = {}
    speedup: dict[str, dict[int, dict[str, float]]] = {}
    for tail in tails:
        for e in engines:
            by_lag = table.setdefault(tail, {}).setdefault(e, {})
            for lag in lags:
                cfg = SimConfig(engines=e, max_lag=lag, prompts_per_step=a.prompts_per_step,
                                group_size=a.group_size, slots=a.slots, token_s=token_s,
                                step_s=step_s, sync_s=sync_s, steps=a.steps, warmup=a.warmup,
                                seed=a.seed, overhead_s=overhead_s)  # fmt: skip
                r = simulate(cfg, tail, a.base_len)
                by_lag[lag] = dataclasses.asdict(r)
                print(f"{tail:>9} {e:>3} {lag:>3} {r.steps_per_hour:>9.1f} "
                      f"{r.seconds_per_step:>7.3f} {r.trainer_idle_fraction:>7.3f} "
                      f"{r.engine_idle_fraction:>7.3f} {r.slot_idle_fraction:>9.3f} "
                      f"{r.dropped_lag:>7}  {r.lag_counts}")  # fmt: skip
            if 0 in by_lag and len(by_lag) > 1:
                top = max((k for k in by_lag if k > 0), key=lambda k: by_lag[k]["steps_per_hour"])
                ratio = by_lag[top]["steps_per_hour"] / by_lag[0]["steps_per_hour"]
                speedup.setdefault(tail, {})[e] = {"max_lag": top, "ratio": ratio}
    best = {t: max(({"engines": e, **v} for e, v in s.items()), key=lambda b: b["ratio"])
            for t, s in speedup.items()}  # fmt: skip
    print("async/sync speedup (steps/hour at the best max_lag > 0 over max_lag 0):")
    for tail, b in best.items():
        ratios = {e: round(v["ratio"], 3) for e, v in speedup[tail].items()}
        print(f"  {tail:>9}: {ratios}  (largest {b['ratio']:.2f}x at {b['engines']:.0f} "
              f"engines, max_lag {b['max_lag']:.0f})")  # fmt: skip
    note = (
        "anchors are published figures of other systems (their models, hardware and lengths), "
        "not reproductions; the speedups here come from this simulator's model"
    )
    print("anchors: " + "; ".join(f"{k} {v}" for k, v in ANCHORS.items()) + f" -- {note}")
    out = {
        "inputs": {"token_s": token_s, "overhead_s": overhead_s, "step_s": step_s, "sync_s": sync_s,
                   "prompts_per_step": a.prompts_per_step, "group_size": a.group_size,
                   "slots": a.slots, "base_len": a.base_len, "steps": a.steps,
                   "warmup": a.warmup, "source": str(a.measured or "MEASURED")},
        "async_over_sync_best": {t: round(b["ratio"], 3) for t, b in best.items()},
        "async_over_sync_best_at": best,
        "async_over_sync": speedup,
        "results": table,
        "anchors": ANCHORS,
        "anchors_note": note,
    }  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
