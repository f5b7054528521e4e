"""The status reply, built from a `StatusSnapshot` of the gateway state, and its text
rendering for the CLI."""

from __future__ import annotations

import dataclasses

from gateway.versions import Engine
from protos import gateway_pb2 as gpb

_PHASES = {0: "-", 1: "ready", 2: "loaded", 3: "FAILED"}


@dataclasses.dataclass(frozen=True)
class StatusSnapshot:
    """What `build_status` reports, copied out of the gateway state under its lock.

    Times are seconds: `now` and `started` on the state's clock, `wall` on
    `time.monotonic()` (the rate window's clock). `engines` are copies of the records;
    `leased` counts each engine's leased prompts; `rates` holds (wall s, completions, tokens)
    of each return in the last minute; `metrics` maps a source to (step, clock s, values).
    """

    now: float
    wall: float
    started: float
    version: int
    shutting_down: bool
    settings: gpb.RunSettings
    engines: tuple[Engine, ...]
    leased: dict[str, int]
    queues: gpb.QueueDepths
    counters: dict[str, int]
    rates: tuple[tuple[float, int, int], ...]
    metrics: dict[str, tuple[int, float, dict[str, float]]]


def build_status(snap: StatusSnapshot) -> gpb.StatusReply:
    """Fill a StatusReply from `snap` (no lock needed: it holds copies)."""
    now = snap.now
    reply = gpb.StatusReply(
        current_version=snap.version,
        settings=snap.settings,
        uptime_s=now - snap.started,
        shutting_down=snap.shutting_down,
    )
    for e in snap.engines:
        r = e.request
        reply.engines.add(
            engine_id=e.engine_id,
            name=r.name,
            backend=r.backend,
            host=r.host,
            device_count=r.device_count,
            tp_size=r.tp_size,
            weight_version=e.weight_version,
            sync_phase=e.sync_phase,
            last_seen_s=now - e.last_seen,
            leased_prompts=snap.leased.get(e.engine_id, 0),
            active_prompts=e.active_prompts,
            groups_returned=e.groups,
            completions_returned=e.completions,
            tokens_returned=e.tokens,
            sync_version=e.sync_version,
            sync_error=e.sync_error,
            serving=e.serving,
        )
    reply.queues.CopyFrom(snap.queues)
    for name in gpb.Counters.DESCRIPTOR.fields_by_name:
        setattr(reply.counters, name, snap.counters.get(name, 0))
    if snap.rates:
        span = max(snap.wall - snap.rates[0][0], 1.0)
        reply.completions_per_s = sum(r[1] for r in snap.rates) / span
        reply.tokens_per_s = sum(r[2] for r in snap.rates) / span
    for source, (step, t, values) in sorted(snap.metrics.items()):
        reply.metrics.add(source=source, step=step, age_s=now - t, values=values)
    return reply


def _sync_text(e: gpb.EngineStatus) -> str:
    """The sync phase of one engine, e.g. "loaded", or for a failure the failed version, its
    error and whether the engine still serves its previous version."""
    phase = _PHASES.get(e.sync_phase, "?")
    if e.sync_phase == gpb.SYNC_PHASE_FAILED:
        phase = f"FAILED v{e.sync_version}: {e.sync_error}"
    if not e.serving:
        return f"{phase}; NOT SERVING"
    if e.sync_phase == gpb.SYNC_PHASE_FAILED:
        return f"{phase}; serving v{e.weight_version}"
    return phase


def format_status(s: gpb.StatusReply) -> str:
    """Render a StatusReply as a few lines of text for `python -m gateway status`."""
    run = s.settings
    lines = [
        f"version {s.current_version}  family {run.model_family or '-'}  dtype {run.dtype or '-'}"
        f"  transport {run.transport or '-'}  uptime {s.uptime_s:.0f} s"
        + ("  SHUTTING DOWN" if s.shutting_down else ""),
        f"queues: eval {s.queues.pending_eval}  train {s.queues.pending_train}  leased "
        f"{s.queues.leased_prompts}  ready {s.queues.ready_groups}/{s.queues.rollout_capacity}",
        f"rates: {s.completions_per_s:.1f} completions/s  {s.tokens_per_s:.0f} tokens/s",
        "counters: "
        + "  ".join(
            f"{f.name} {getattr(s.counters, f.name)}" for f in gpb.Counters.DESCRIPTOR.fields
        ),
        f"engines ({len(s.engines)}):",
    ]
    for e in s.engines:
        lines.append(
            f"  {e.engine_id}  {e.backend} tp{e.tp_size}/{e.device_count}  v{e.weight_version} "
            f"({_sync_text(e)})  leased {e.leased_prompts}  groups "
            f"{e.groups_returned}  tokens {e.tokens_returned}  seen {e.last_seen_s:.1f} s ago"
        )
    for m in s.metrics:
        values = " ".join(f"{k}={v:.4g}" for k, v in sorted(m.values.items()))
        lines.append(f"metrics {m.source} step {m.step} ({m.age_s:.0f} s ago): {values}")
    return "\n".join(lines)
