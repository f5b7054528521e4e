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
| `far` | (a mixed plan only) JSON `{"names", "transport", "manifest"}`: the far engines, by
  registered name, and the delta stream they pull the same version from (`FarLeg`) |

(+) A sharded manifest also carries `tp_size`, `num_kv_heads` and each tensor's shard kind.

A mixed plan (`launch.far_engines`) feeds near engines over the run's data plane (gloo, shm or
file: `transport`, `manifest`, `ranks`) and far engines over the delta stream (`far`), in one
publication of one version: an engine whose registered name `is_far_name` answers True reads
the `far` leg and is no member of the near group (`SyncPlan.leg`).

Pure Python (no torch, numpy or JAX at import time); the gateway itself never imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transport.manifest import Manifest, ManifestError

KEYS = ("transport", "manifest", "ranks", "world_size", "group")
FAR_KEY = "far"


def is_far_name(name: str, far_names: tuple[str, ...] | frozenset[str]) -> bool:
    """Whether an engine registered as `name` is one of `far_names`: the name itself, or the
    name followed by "-" and anything (a hosts job names engine i ``engine{i}-HOST``;
    ``engine1`` never matches ``engine10``)."""
    return any(name == n or name.startswith(n + "-") for n in far_names)


@dataclass(frozen=True)
class FarLeg:
    """The far engines' part of a mixed plan: who they are and where they pull the version.

    Attributes:
        names: registered engine names (`is_far_name`) fed over the delta stream.
        transport: a `DeltaStreamTransportConfig` as a dict (its bound port filled in).
        manifest: the version's whole-tensor manifest at the delta stream's bucket size.
    """

    names: tuple[str, ...]
    transport: dict[str, Any]
    manifest: Manifest

    def to_json(self) -> str:
        """The leg as the `far` param's JSON."""
        return json.dumps({"names": list(self.names), "transport": self.transport,
                           "manifest": self.manifest.to_dict()}, sort_keys=True)  # fmt: skip

    @classmethod
    def from_json(cls, text: str, version: int) -> FarLeg:
        """Read the `far` param back.

        Raises:
            SyncPlanError: malformed JSON, a transport other than the delta stream, a
                manifest of another version or a sharded one.
        """
        try:
            d = json.loads(text)
            names = tuple(str(n) for n in d["names"])
            transport, manifest = d["transport"], Manifest.from_dict(d["manifest"])
        except (json.JSONDecodeError, ManifestError, KeyError, TypeError, AttributeError) as e:
            raise SyncPlanError(f"malformed far leg for version {version}: {e!r}") from e
        if not isinstance(transport, dict) or transport.get("kind") != "delta_stream":
            raise SyncPlanError(f"far leg: expected a delta_stream transport, got {transport!r}")
        if manifest.version != version or manifest.sharded:
            raise SyncPlanError(
                f"far leg: expected a whole-tensor manifest of version {version}, got version "
                f"{manifest.version} (sharded: {manifest.sharded})"
            )
        return cls(names, transport, manifest)


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
        far: in a mixed plan, the far engines and their delta stream (`FarLeg`); None when
            every engine takes `transport`.
    """

    transport: dict[str, Any]
    manifest: Manifest
    ranks: dict[str, int]
    world_size: int
    group: int = 0
    far: FarLeg | None = None

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

    def leg(self, engine_id: str, name: str) -> tuple[dict[str, Any], Manifest, int]:
        """(transport dict, manifest, group rank) of engine `engine_id` registered as `name`:
        the far leg's (rank 1, unused by the delta stream) when `name` is a far engine's,
        else the near group's.

        Raises:
            SyncPlanError: a near engine outside the group (as `rank_of`).
        """
        if self.far is not None and is_far_name(name, self.far.names):
            return self.far.transport, self.far.manifest, 1
        return self.transport, self.manifest, self.rank_of(engine_id)

    def to_params(self) -> dict[str, str]:
        """The directive params (see the module docstring)."""
        params = {
            "transport": json.dumps(self.transport, sort_keys=True),
            "manifest": self.manifest.to_json().decode(),
            "ranks": json.dumps(self.ranks, sort_keys=True),
            "world_size": str(self.world_size),
            "group": str(self.group),
        }
        if self.far is not None:
            params[FAR_KEY] = self.far.to_json()
        return params

    @classmethod
    def from_params(cls, params: Mapping[str, str], version: int) -> SyncPlan:
        """Read a plan back from directive params and check it announces `version`.

        Raises:
            SyncPlanError: a missing key, malformed JSON, or a manifest of another version
                (the far leg's included).
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
        far = FarLeg.from_json(params[FAR_KEY], version) if FAR_KEY in params else None
        return cls(transport, manifest, ranks, world_size, group, far)
