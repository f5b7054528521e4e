"""Typed messages of the client API: what the trainer and engines hand to and get from
`GatewayClient`. `gateway.convert` turns them into protos and back.

Token ids are int32 vocabulary indices; log-probs are float32 natural logs of the sampled
token's probability under the sampling distribution; versions are published weight versions.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gateway.config import RunSettings  # the Configure message; defined beside the server config

FINISH_REASONS = ("stop", "length", "abort")
SYNC_PHASES = ("ready", "loaded", "failed")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample a prompt's G completions (see protos/rollout.proto for the ranges)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    reasoning_budget: int = 0


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt to complete `group_size` times.

    Attributes:
        sample_id: unique among prompts in flight.
        token_ids: int32 [P], P >= 1.
        group_size: G >= 1.
        sampling: sampling parameters.
        is_eval: eval prompts are leased before training prompts.
        min_version: only engines holding at least this weight version may lease it.
    """

    sample_id: str
    token_ids: np.ndarray
    group_size: int
    sampling: SamplingParams = SamplingParams()
    is_eval: bool = False
    min_version: int = 0


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion.

    Attributes:
        token_ids: int32 [L] generated tokens (prompt excluded).
        logprobs: float32 [L] log-prob of each sampled token.
        finish_reason: "stop", "length" or "abort".
        version_start, version_end: weight versions at the first and the last token.
        version_spans: (version, start token, end token) triples, when the version changed.
        first_token_s, generation_s: seconds from the engine taking the prompt.
        forced_positions: indices into token_ids (ascending) of tokens the engine wrote without
            sampling them (log-prob 0); the trainer masks them out of the loss.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    version_start: int
    version_end: int
    version_spans: tuple[tuple[int, int, int], ...] = ()
    first_token_s: float = 0.0
    generation_s: float = 0.0
    forced_positions: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class RolloutGroup:
    """A prompt's G completions. Engines fill sample_id and completions; the gateway adds
    engine_id, the prompt, and the seconds spent queued (queue_s) and leased (lease_s)."""

    sample_id: str
    completions: tuple[Completion, ...]
    engine_id: str = ""
    prompt: Prompt | None = None
    queue_s: float = 0.0
    lease_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What an engine says about itself when it registers."""

    backend: str
    model_family: str
    dtype: str
    transports: tuple[str, ...]
    device_count: int = 1
    tp_size: int = 1
    name: str = ""
    weight_version: int = 0
    host: str = ""


@dataclasses.dataclass(frozen=True)
class SyncDirective:
    """Load `target_version` at the next safe point; `params` come from the trainer."""

    target_version: int
    params: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Registration:
    """An accepted engine: its id, the agreed settings and the timing it must keep.

    `engine_key` is the secret every later call about this engine carries (the client that
    registered keeps it and sends it by itself; give it to another client with
    `GatewayClient.adopt_engine`). Only calls carrying it keep the engine alive.
    """

    engine_id: str
    settings: RunSettings
    current_version: int
    sync: SyncDirective | None
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    lease_seconds: float
    engine_key: str = dataclasses.field(default="", repr=False)


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """A heartbeat's answer."""

    sync: SyncDirective | None
    current_version: int
    shutting_down: bool


@dataclasses.dataclass(frozen=True)
class Lease:
    """Prompts leased to one engine; empty `prompts` (and lease_id) when none came."""

    lease_id: str
    prompts: tuple[Prompt, ...]
    expires_in_s: float
    sync: SyncDirective | None
    shutting_down: bool
    backpressure: bool


@dataclasses.dataclass(frozen=True)
class ReturnResult:
    """Groups accepted, dropped (late or repeated, with the reason) and prompts released."""

    accepted: int
    dropped: int
    dropped_reason: str
    released: int


@dataclasses.dataclass(frozen=True)
class EngineSyncState:
    """The last sync progress an engine reported.

    Attributes:
        engine_id: the engine.
        version: the last version it acknowledged a phase for.
        phase: "ready", "loaded" or "failed" ("unspecified" before any ack).
        error: why the load failed (phase "failed" only).
        serving: the engine holds a whole version and may lease; false only after a
            "failed" that left it without one, until it loads a version.
    """

    engine_id: str
    version: int
    phase: str
    error: str
    serving: bool = True


@dataclasses.dataclass(frozen=True)
class SyncResult:
    """WaitSync's answer: done when every live engine reached the phase."""

    done: bool
    engines: tuple[EngineSyncState, ...]
