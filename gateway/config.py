"""Server settings: lease and heartbeat timing, queue bounds, message limits, run defaults.

Imports nothing heavy; `python -m gateway serve` builds one from its flags.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """Settings of one gateway server.

    Attributes:
        lease_seconds: a lease expires this many seconds after it was granted (s, > 0).
        heartbeat_timeout_s: an engine silent for this long is dropped and its leases expire
            at once (s, > 0). Any engine call counts as a heartbeat.
        heartbeat_interval_s: how often engines are told to heartbeat (s, 0 < it < timeout);
            0 means a third of the timeout.
        max_pending_prompts: most prompts waiting to be leased (>= 1).
        rollout_capacity: most groups leased or waiting for the trainer together (>= 1); when
            reached, engines get no new prompts until the trainer fetches (back-pressure).
        max_wait_s: cap on any blocking call's timeout (s, > 0).
        max_message_bytes: largest request or reply (bytes, >= 1 MiB).
        max_group_size: largest G accepted (>= 1).
        max_prompt_tokens: longest prompt accepted (tokens, >= 1).
        model_family, mapping, dtype, transport, rendezvous_address, backends: the run's
            settings before the trainer calls Configure (empty: not decided).
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
    model_family: str = ""
    mapping: str = ""
    dtype: str = ""
    transport: str = ""
    rendezvous_address: str = ""
    backends: tuple[str, ...] = ()

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
        for name in ("max_pending_prompts", "rollout_capacity", "max_group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens: expected >= 1, got {self.max_prompt_tokens}")
        if self.max_message_bytes < 1 << 20:
            raise ValueError(
                f"max_message_bytes: expected >= {1 << 20} (1 MiB), got {self.max_message_bytes}"
            )

    @property
    def heartbeat_every_s(self) -> float:
        """The interval engines are told to heartbeat at (s)."""
        return self.heartbeat_interval_s or self.heartbeat_timeout_s / 3
