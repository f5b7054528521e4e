"""Conversions between the client's dataclasses (`gateway.messages`) and the protos: the one
place a message changes type. Arrays go out as repeated fields and come back as int32 / float32
numpy arrays; the trainer-side annotations of a `Completion` (`reward`, `text`) stay home."""

from __future__ import annotations

import dataclasses

import numpy as np

from gateway import messages as m
from gateway.routes import decode_routes, encode_routes
from protos import gateway_pb2 as gpb
from protos import rollout_pb2 as rpb

_FINISH_TO_PB = {
    "stop": rpb.FINISH_REASON_STOP,
    "length": rpb.FINISH_REASON_LENGTH,
    "abort": rpb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
PHASE_TO_PB = {
    "ready": gpb.SYNC_PHASE_READY,
    "loaded": gpb.SYNC_PHASE_LOADED,
    "failed": gpb.SYNC_PHASE_FAILED,
}
_PHASE_FROM_PB: dict[int, str] = {int(v): k for k, v in PHASE_TO_PB.items()}


def _ints(values) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


_LOGPROBS_TAG = bytes([rpb.Completion.DESCRIPTOR.fields_by_name["logprobs"].number << 3 | 2])


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _merge_logprobs(pb: rpb.Completion, logprobs: np.ndarray) -> None:
    """Append float32 [L] log-probs to `pb.logprobs` as one packed field: the tag, the byte
    length as a base-128 varint, then the values as 4-byte little-endian floats (the wire
    format's rule for packed repeated floats, protobuf.dev "Encoding"), bit for bit, without
    L Python floats (far faster than building them through a list)."""
    payload = np.asarray(logprobs, dtype="<f4").tobytes()
    if payload:
        pb.MergeFromString(_LOGPROBS_TAG + _varint(len(payload)) + payload)


def prompt_to_pb(p: m.Prompt) -> rpb.Prompt:
    """A Prompt as a proto (token ids [P] copied as int32)."""
    s = p.sampling
    sampling = rpb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_new_tokens=s.max_new_tokens,
        stop_token_ids=list(s.stop_token_ids),
        reasoning_budget=s.reasoning_budget,
        ignore_eos=s.ignore_eos,
        return_routes=s.return_routes,
    )
    if s.seed is not None:
        sampling.seed = s.seed
    pb = rpb.Prompt(
        sample_id=p.sample_id,
        token_ids=_ints(p.token_ids),
        group_size=p.group_size,
        sampling=sampling,
        is_eval=p.is_eval,
        min_version=p.min_version,
    )
    if p.episode is not None:
        pb.episode.CopyFrom(rpb.Episode(**dataclasses.asdict(p.episode)))
    return pb


def prompt_from_pb(p: rpb.Prompt) -> m.Prompt:
    """A proto Prompt as a dataclass; token ids become an int32 array [P]."""
    s = p.sampling
    return m.Prompt(
        sample_id=p.sample_id,
        token_ids=np.array(p.token_ids, dtype=np.int32),
        group_size=p.group_size,
        sampling=m.SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_new_tokens=s.max_new_tokens,
            stop_token_ids=tuple(s.stop_token_ids),
            seed=s.seed if s.HasField("seed") else None,
            reasoning_budget=s.reasoning_budget,
            ignore_eos=s.ignore_eos,
            return_routes=s.return_routes,
        ),
        is_eval=p.is_eval,
        min_version=p.min_version,
        episode=_episode(p.episode) if p.HasField("episode") else None,
    )


def _episode(e: rpb.Episode) -> m.Episode:
    return m.Episode(e.env, e.task_json, e.max_turns, e.max_tokens, e.max_observation_chars)


def completion_to_pb(c: m.Completion) -> rpb.Completion:
    """A Completion as a proto.

    Raises:
        ValueError: the finish reason is not "stop", "length" or "abort".
    """
    if c.finish_reason not in _FINISH_TO_PB:
        raise ValueError(
            f"finish_reason: expected one of {m.FINISH_REASONS}, got {c.finish_reason!r}"
        )
    pb = rpb.Completion(
        token_ids=c.token_ids.tolist(),
        finish_reason=_FINISH_TO_PB[c.finish_reason],
        version_start=c.version_start,
        version_end=c.version_end,
        version_spans=[
            rpb.VersionSpan(version=v, start_token=a, end_token=b) for v, a, b in c.version_spans
        ],
        first_token_s=c.first_token_s,
        generation_s=c.generation_s,
        forced_positions=list(c.forced_positions),
        turns=c.turns,
        observations=c.observations,
        env_reward=c.env_reward,
    )
    if c.routed_experts is not None:
        data, layers, k, width = encode_routes(c.routed_experts)
        pb.routed_experts, pb.routed_layers, pb.routed_k, pb.routed_id_bytes = (
            data,
            layers,
            k,
            width,
        )
    _merge_logprobs(pb, c.logprobs)
    return pb


def completion_from_pb(c: rpb.Completion) -> m.Completion:
    """A proto Completion as a dataclass: int32 [L] token ids, float32 [L] log-probs."""
    return m.Completion(
        token_ids=np.array(c.token_ids, dtype=np.int32),
        logprobs=np.array(c.logprobs, dtype=np.float32),
        finish_reason=_FINISH_FROM_PB.get(c.finish_reason, "unspecified"),
        version_start=c.version_start,
        version_end=c.version_end,
        version_spans=tuple((s.version, s.start_token, s.end_token) for s in c.version_spans),
        first_token_s=c.first_token_s,
        generation_s=c.generation_s,
        forced_positions=tuple(c.forced_positions),
        turns=c.turns,
        observations=c.observations,
        env_reward=c.env_reward if c.HasField("env_reward") else None,
        routed_experts=decode_routes(
            c.routed_experts, c.routed_layers, c.routed_k, c.routed_id_bytes
        ),
    )


def group_to_pb(g: m.RolloutGroup) -> rpb.RolloutGroup:
    """A group as the engine sends it (sample id and completions only)."""
    return rpb.RolloutGroup(
        sample_id=g.sample_id, completions=[completion_to_pb(c) for c in g.completions]
    )


def group_from_pb(g: rpb.RolloutGroup) -> m.RolloutGroup:
    """A group as the trainer receives it, with the gateway's stamps."""
    return m.RolloutGroup(
        sample_id=g.sample_id,
        completions=tuple(completion_from_pb(c) for c in g.completions),
        engine_id=g.engine_id,
        prompt=prompt_from_pb(g.prompt) if g.HasField("prompt") else None,
        queue_s=g.queue_s,
        lease_s=g.lease_s,
    )


def settings_to_pb(s: m.RunSettings) -> gpb.RunSettings:
    """RunSettings as a proto."""
    return gpb.RunSettings(
        model_family=s.model_family,
        mapping=s.mapping,
        dtype=s.dtype,
        transport=s.transport,
        rendezvous_address=s.rendezvous_address,
        backends=list(s.backends),
        adapter=s.adapter,
    )


def settings_from_pb(s: gpb.RunSettings) -> m.RunSettings:
    """A proto RunSettings as a dataclass."""
    return m.RunSettings(
        model_family=s.model_family,
        mapping=s.mapping,
        dtype=s.dtype,
        transport=s.transport,
        rendezvous_address=s.rendezvous_address,
        backends=tuple(s.backends),
        adapter=s.adapter,
    )


def spec_to_pb(e: m.EngineSpec) -> gpb.RegisterRequest:
    """An EngineSpec as a RegisterRequest."""
    return gpb.RegisterRequest(
        name=e.name,
        backend=e.backend,
        device_count=e.device_count,
        tp_size=e.tp_size,
        model_family=e.model_family,
        dtype=e.dtype,
        transports=list(e.transports),
        weight_version=e.weight_version,
        host=e.host,
        adapter=e.adapter,
    )


def sync_from_pb(d: gpb.SyncDirective) -> m.SyncDirective | None:
    """A directive, or None when no sync is pending."""
    return m.SyncDirective(d.target_version, dict(d.params), d.seq) if d.pending else None


def phase_from_pb(phase: int) -> str:
    """A SyncPhase enum value as "ready", "loaded", "failed" (or "unspecified")."""
    return _PHASE_FROM_PB.get(phase, "unspecified")
