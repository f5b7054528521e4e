"""What a sync directive carries: how an engine joins the data plane and what version comes.

The trainer's `WeightPublisher` (trainer/publish/) writes a `SyncPlan` into the params of
`PublishVersion`; every engine reads it back from its sync directive (rollout_engine/worker.py).
The params are a flat `dict[str, str]` (the gateway carries them opaquely):

| key | value |
| --- | --- |
| `transport` | JSON of a `transport.config.TransportConfig` (the bound port filled in) |
| `manifest` | `Manifest.to_json()`: version, names, shapes, wire dtype, bucket size (+) |
| `ranks` | JSON `{engine_id: group rank of the engine's TP rank 0}` (after the senders) |
| `world_size` | group size: the senders (`Manifest.senders`) + every receiving TP rank |
| `group` | generation of the group; an engine joins afresh whenever it changes |

(+) A sharded manifest also carries `tp_size`, `num_kv_heads` and each tensor's shard kind.

Pure Python (no torch, numpy or JAX at import time); the gateway itself never imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transport.manifest import Manifest, ManifestError

KEYS = ("transport", "manifest", "ranks", "world_size", "group")


class SyncPlanError(ValueError):
    """Sync directive params that are missing, malformed or do not name this engine."""


@dataclass(frozen=True)
class SyncPlan:
    """One published version as the engines must receive it.

    Attributes:
        transport: a `TransportConfig` as a dict (`kind` = gloo | nccl | file, ...).
        manifest: the version's tensors (HF names, full shapes, wire dtype) and bucket size.
        ranks: engine id -> group rank of its tensor-parallel rank 0 (>= the manifest's
            `senders`: ranks 0..senders-1 are the trainer processes that send).
        world_size: the senders + the receiving ranks of every engine together.
        group: generation of the data-plane group (>= 0). The trainer forms a new group
            (and bumps this) when the engines change or a push failed, since a failed
            collective leaves the old one out of step; engines join afresh when it changes.
    """

    transport: dict[str, Any]
    manifest: Manifest
    ranks: dict[str, int]
    world_size: int
    group: int = 0

    def __post_init__(self) -> None:
        if "kind" not in self.transport:
            raise SyncPlanError(f"transport: expected a dict with a 'kind', got {self.transport}")
        if self.world_size < 2:
            raise SyncPlanError(f"world_size: expected >= 2, got {self.world_size}")
        first = self.manifest.senders
        bad = {e: r for e, r in self.ranks.items() if not first <= r < self.world_size}
        if bad:
            raise SyncPlanError(f"ranks: expected {first}..{self.world_size - 1}, got {bad}")

    @property
    def version(self) -> int:
        """The weight version on offer (the manifest's)."""
        return self.manifest.version

    def rank_of(self, engine_id: str) -> int:
        """Group rank of `engine_id`'s TP rank 0.

        Raises:
            SyncPlanError: the engine is not in the group (it registered after the trainer
                formed it); it must wait for the next version.
        """
        if engine_id not in self.ranks:
            raise SyncPlanError(
                f"engine {engine_id!r} is not in the data-plane group of version "
                f"{self.version} (members: {sorted(self.ranks)}); it joins at the next version"
            )
        return self.ranks[engine_id]

    def to_params(self) -> dict[str, str]:
        """The directive params (see the module docstring)."""
        return {
            "transport": json.dumps(self.transport, sort_keys=True),
            "manifest": self.manifest.to_json().decode(),
            "ranks": json.dumps(self.ranks, sort_keys=True),
            "world_size": str(self.world_size),
            "group": str(self.group),
        }

    @classmethod
    def from_params(cls, params: Mapping[str, str], version: int) -> SyncPlan:
        """Read a plan back from directive params and check it announces `version`.

        Raises:
            SyncPlanError: a missing key, malformed JSON, or a manifest of another version.
        """
        missing = [k for k in KEYS if k not in params]
        if missing:
            raise SyncPlanError(
                f"sync directive for version {version} lacks params {missing}; expected "
                f"{list(KEYS)}, got {sorted(params)} (was it published by WeightPublisher?)"
            )
        try:
            transport = json.loads(params["transport"])
            manifest = Manifest.from_json(params["manifest"].encode())
            ranks = {str(k): int(v) for k, v in json.loads(params["ranks"]).items()}
            world_size = int(params["world_size"])
            group = int(params["group"])
        except (json.JSONDecodeError, ManifestError, TypeError, ValueError, AttributeError) as e:
            raise SyncPlanError(
                f"malformed sync directive params for version {version}: {e}"
            ) from e
        if manifest.version != version:
            raise SyncPlanError(
                f"sync directive targets version {version}, its manifest is of version "
                f"{manifest.version}"
            )
        if not isinstance(transport, dict):
            raise SyncPlanError(f"transport: expected a JSON object, got {transport!r}")
        return cls(transport, manifest, ranks, world_size, group)
