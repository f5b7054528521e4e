"""Server settings: lease and heartbeat timing, queue bounds, message limits, and the run
settings (`RunSettings`, also the Configure message) it starts with.

Imports nothing heavy; `python -m gateway serve` builds one from its flags.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The run's settings as the trainer configures them (empty: not decided): the model
    family, its mapping (empty: the family's own), the wire dtype, the data-plane transport,
    its rendezvous address (HOST:PORT), the engine backends the run accepts and, for an
    adapter-only run, the LoRA adapter its engines must serve (`adapter`, compared as text
    with the engine's own: `transport.adapter_spec.adapter_key`)."""

    model_family: str = ""
    mapping: str = ""
    dtype: str = ""
    transport: str = ""
    rendezvous_address: str = ""
    backends: tuple[str, ...] = ()
    adapter: str = ""


#: Most characters in PublishVersion's params when `max_param_bytes` is 0 (4 MiB).
DEFAULT_PARAM_BYTES = 4 << 20
_AT_LEAST_ONE = (
    "max_pending_prompts",
    "rollout_capacity",
    "max_group_size",
    "max_prompt_tokens",
    "max_new_tokens",
    "max_name_chars",
    "max_text_chars",
    "max_task_chars",
    "max_route_bytes",
    "max_turns",
    "max_list_items",
    "max_prompts_per_call",
    "max_metric_keys",
    "max_metric_sources",
    "max_param_entries",
    "max_engines",
    "max_concurrent_rpcs",
    "max_prompt_releases",
)


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """Settings of one gateway server.

    Attributes:
        lease_seconds: a lease expires this many seconds after it was granted (s, > 0).
        heartbeat_timeout_s: an engine silent for this long is dropped and its leases expire
            at once (s, > 0). Any call carrying the engine's engine_key counts as a heartbeat.
        heartbeat_interval_s: how often engines are told to heartbeat (s, 0 < it < timeout);
            0 means a third of the timeout.
        max_pending_prompts: most prompts waiting to be leased (>= 1).
        rollout_capacity: most groups leased or waiting for the trainer together (>= 1); when
            reached, engines get no new prompts until the trainer fetches (back-pressure).
        max_wait_s: cap on any blocking call's timeout (s, > 0).
        max_message_bytes: largest request or reply (bytes, >= 1 MiB).
        max_group_size: largest G accepted (>= 1).
        max_prompt_tokens: longest prompt accepted (tokens, >= 1).
        max_new_tokens: largest `max_new_tokens` a prompt may ask for, and so the longest
            completion (tokens, >= 1).
        max_name_chars: longest id, name or key (sample and engine ids, engine names and
            keys, backends, dtypes, transports, metric sources and keys, param keys;
            characters, >= 64).
        max_text_chars: longest free text (an ack's error, a shutdown reason, the rendezvous
            address; characters).
        max_task_chars: longest task of a multi-turn episode (`Episode.task_json`;
            characters, >= 1).
        max_route_bytes: most bytes of one completion's routed experts (routing replay,
            `Completion.routed_experts`: tokens x MoE layers x k x 1 or 2 bytes; >= 1). The
            default holds 32k tokens of a 48-layer top-8 model with 2-byte ids.
        max_turns: most model turns an episode may ask for (>= 1).
        max_list_items: most entries of a list of names or a small list (transports,
            backends, stop token ids; >= 1).
        max_prompts_per_call: most prompts in one SubmitPrompts, and most groups or released
            ids in one ReturnRollouts (>= 1).
        max_metric_keys: most values in one ReportMetrics (>= 1).
        max_metric_sources: most metric sources kept; a new one evicts the one reported
            longest ago (>= 1).
        max_param_entries: most entries in PublishVersion's params (>= 1).
        max_param_bytes: most characters in PublishVersion's params, keys and values
            together (at most a quarter of `max_message_bytes`: they ride in every directive);
            0: `DEFAULT_PARAM_BYTES` (4 MiB) or a quarter of `max_message_bytes` if smaller.
            The sync plan's manifest is most of it, about 100 characters per tensor (more
            with several senders): 4 MiB holds tens of thousands of tensors; raise it for
            more.
        max_engines: most engines registered at once; beyond it RegisterEngine answers
            RESOURCE_EXHAUSTED (>= 1).
        max_concurrent_rpcs: calls in progress at once, and the server's thread count: an
            admitted call never waits for a thread; more get RESOURCE_EXHAUSTED from gRPC.
        max_prompt_releases: how many times engines may give one prompt back unserved (an
            engine's backend failed on it, or the engine stopped or failed an update while it
            ran) before the gateway gives up on it and hands the trainer an aborted group in
            its place (every completion empty, finish reason "abort"; the trainer drops it),
            so a prompt that fails every engine cannot circle the queue forever (>= 1).
        max_long_polls: LeasePrompts, FetchRollouts, SubmitPrompts and WaitSync calls that
            may wait at once; one more that would wait gets RESOURCE_EXHAUSTED. 0: half of
            `max_concurrent_rpcs`.
        max_heartbeat_polls: heartbeats that may wait at once; one more answers at once (it
            still counts as a heartbeat, it is never refused for this). 0: a quarter of
            `max_concurrent_rpcs`. The two caps together leave at least a quarter of the
            threads to calls that do not wait.
        min_version_ahead: a prompt's `min_version` may exceed the current weight version by
            at most this (>= 0): the trainer publishes a version before (or, at most, while)
            it submits for it.
        settings: the run's settings before the trainer calls Configure (empty fields: not
            decided).
    """

    lease_seconds: float = 600.0
    heartbeat_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.0
    max_pending_prompts: int = 100_000
    rollout_capacity: int = 4096
    max_wait_s: float = 60.0
    max_message_bytes: int = 64 * 1024 * 1024
    max_group_size: int = 1024
    max_prompt_tokens: int = 1 << 20
    max_new_tokens: int = 1 << 20
    max_name_chars: int = 256
    max_text_chars: int = 4096
    max_task_chars: int = 65_536
    max_route_bytes: int = 1 << 25
    max_turns: int = 64
    max_list_items: int = 64
    max_prompts_per_call: int = 65_536
    max_metric_keys: int = 256
    max_metric_sources: int = 64
    max_param_entries: int = 64
    max_param_bytes: int = 0
    max_engines: int = 1024
    max_concurrent_rpcs: int = 128
    max_long_polls: int = 0
    max_heartbeat_polls: int = 0
    max_prompt_releases: int = 5
    min_version_ahead: int = 1
    settings: RunSettings = dataclasses.field(default_factory=lambda: RunSettings())

    def __post_init__(self) -> None:
        for name in ("lease_seconds", "heartbeat_timeout_s", "max_wait_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a finite number of seconds > 0, got {value}")
        hb = self.heartbeat_interval_s
        if not (math.isfinite(hb) and 0 <= hb < self.heartbeat_timeout_s):
            raise ValueError(
                f"heartbeat_interval_s: expected 0 <= it < heartbeat_timeout_s "
                f"({self.heartbeat_timeout_s}), got {hb}"
            )
        for name in _AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.max_message_bytes < 1 << 20:
            raise ValueError(
                f"max_message_bytes: expected >= {1 << 20} (1 MiB), got {self.max_message_bytes}"
            )
        if not 0 <= self.max_param_bytes <= self.max_message_bytes // 4:
            raise ValueError(
                f"max_param_bytes: expected 0..max_message_bytes / 4 "
                f"({self.max_message_bytes // 4}), got {self.max_param_bytes}"
            )
        if self.max_name_chars < 64:
            raise ValueError(
                f"max_name_chars: expected >= 64 (engine ids and keys need room), "
                f"got {self.max_name_chars}"
            )
        if self.min_version_ahead < 0:
            raise ValueError(f"min_version_ahead: expected >= 0, got {self.min_version_ahead}")
        for name in ("max_long_polls", "max_heartbeat_polls"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0 (0: derived), got {getattr(self, name)}")
        spare = self.max_concurrent_rpcs - self.long_poll_limit - self.heartbeat_poll_limit
        if self.long_poll_limit < 1 or self.heartbeat_poll_limit < 1 or spare < 4:
            raise ValueError(
                f"max_long_polls ({self.long_poll_limit}) + max_heartbeat_polls "
                f"({self.heartbeat_poll_limit}): expected each >= 1 and their sum at least 4 "
                f"below max_concurrent_rpcs ({self.max_concurrent_rpcs}), so calls that do "
                "not wait always find a thread"
            )

    @property
    def param_bytes_limit(self) -> int:
        """Most characters in PublishVersion's params (see `max_param_bytes`)."""
        return self.max_param_bytes or min(DEFAULT_PARAM_BYTES, self.max_message_bytes // 4)

    @property
    def long_poll_limit(self) -> int:
        """Calls other than heartbeats that may wait at once (see `max_long_polls`)."""
        return self.max_long_polls or self.max_concurrent_rpcs // 2

    @property
    def heartbeat_poll_limit(self) -> int:
        """Heartbeats that may wait at once (see `max_heartbeat_polls`)."""
        return self.max_heartbeat_polls or self.max_concurrent_rpcs // 4

    @property
    def heartbeat_every_s(self) -> float:
        """The interval engines are told to heartbeat at (s)."""
        return self.heartbeat_interval_s or self.heartbeat_timeout_s / 3
