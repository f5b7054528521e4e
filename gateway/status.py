"""The status snapshot (built under the state's lock) and its text rendering for the CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protos import gateway_pb2 as gpb

if TYPE_CHECKING:
    from gateway.state import GatewayState

_PHASES = {0: "-", 1: "ready", 2: "loaded", 3: "FAILED"}


def build_status(state: GatewayState, now: float, wall: float) -> gpb.StatusReply:
    """Fill a StatusReply from `state` (caller holds its lock).

    Args:
        state: the gateway state.
        now: the state's clock (s), for ages.
        wall: `time.monotonic()` (s); the rate window is its last minute.
    """
    settings, engines, metrics, rates, started = state.views()
    q = state.queue
    reply = gpb.StatusReply(
        current_version=state.version,
        settings=settings,
        uptime_s=now - started,
        shutting_down=state.shutting_down,
    )
    leased: dict[str, int] = {}
    for lease in q.leases.values():
        leased[lease.engine_id] = leased.get(lease.engine_id, 0) + len(lease.outstanding)
    for e in engines.values():
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
            leased_prompts=leased.get(e.engine_id, 0),
            active_prompts=e.active_prompts,
            groups_returned=e.groups,
            completions_returned=e.completions,
            tokens_returned=e.tokens,
            sync_version=e.sync_version,
            sync_error=e.sync_error,
            serving=e.serving,
        )
    reply.queues.CopyFrom(
        gpb.QueueDepths(
            pending_eval=q.pending(True),
            pending_train=q.pending(False),
            leased_prompts=q.leased_prompts,
            ready_groups=q.ready,
            rollout_capacity=q.rollout_capacity,
        )
    )
    for name in gpb.Counters.DESCRIPTOR.fields_by_name:
        setattr(reply.counters, name, q.counters[name])
    if rates:
        span = max(wall - rates[0][0], 1.0)
        reply.completions_per_s = sum(r[1] for r in rates) / span
        reply.tokens_per_s = sum(r[2] for r in rates) / span
    for source, (step, t, values) in sorted(metrics.items()):
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
