"""What an adapter-only weight version carries besides its tensors: the LoRA shape facts.

A LoRA push (`sync.lora_only`) sends only the adapters, in PEFT naming (per adapted projection
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]); the
manifest's `adapter` field says their rank, scaling numerator and target projections, so an
engine checks them against the adapter it started with before anything is received. Pure
Python (no numpy, torch or JAX at import time), as `transport.manifest`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


class AdapterMismatch(ValueError):
    """An adapter-only version whose rank or targets differ from the engine's, or one offered
    to an engine that serves no adapter (or full weights to one that serves only adapters)."""


@dataclass(frozen=True)
class AdapterSpec:
    """The LoRA adapter (Hu et al. 2021, arXiv:2106.09685) a version is made of.

    Attributes:
        rank: r >= 1 of every adapter.
        alpha: the scaling numerator (PEFT's `lora_alpha`); each projection's update is
            (alpha / r) B A in PEFT's layout ([out, r] @ [r, in]).
        targets: the adapted projections by their PEFT names (`q_proj`, ..., `down_proj`),
            sorted, unique, non-empty.

    Raises:
        AdapterMismatch: a rank < 1, a non-positive or non-finite alpha, or empty, unsorted or
            repeated targets.
    """

    rank: int
    alpha: float
    targets: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise AdapterMismatch(f"adapter rank must be an int >= 1, got {self.rank!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise AdapterMismatch(f"adapter alpha must be finite and > 0, got {self.alpha!r}")
        if not self.targets or list(self.targets) != sorted(set(self.targets)):
            raise AdapterMismatch(
                f"adapter targets must be sorted, unique and non-empty, got {list(self.targets)}"
            )

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor of B A (PEFT's `scaling` without rslora)."""
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        """PEFT's `adapter_config.json` keys: `r`, `lora_alpha`, `target_modules`."""
        return {"r": self.rank, "lora_alpha": self.alpha, "target_modules": list(self.targets)}

    @classmethod
    def from_dict(cls, d: dict) -> AdapterSpec:
        """Inverse of `to_dict`. Raises KeyError / TypeError / ValueError when malformed."""
        return cls(int(d["r"]), float(d["lora_alpha"]), tuple(str(t) for t in d["target_modules"]))

    @classmethod
    def of(cls, rank: int, alpha: float, targets: tuple[str, ...] | list[str]) -> AdapterSpec:
        """A spec with `targets` sorted and de-duplicated."""
        return cls(int(rank), float(alpha), tuple(sorted(set(targets))))


def served_adapter(rank: int, targets: Sequence[str]) -> AdapterSpec | None:
    """The adapter an engine started with `rank` and `targets` serves (its alpha comes with
    each version: the 1.0 here is a placeholder `check_adapter` ignores); None for rank 0.

    Raises:
        AdapterMismatch: a rank > 0 without targets.
    """
    return AdapterSpec.of(rank, 1.0, tuple(targets)) if rank else None


def adapter_key(rank: int, targets: Sequence[str]) -> str:
    """The text that stands for a LoRA adapter's shape at registration
    (`gateway.config.RunSettings.adapter`, compared as text by the gateway, which imports no
    data-plane code): ``"lora r=8 targets=k_proj,q_proj"``; "" for rank 0 (full weights)."""
    return f"lora r={rank} targets={','.join(sorted(set(targets)))}" if rank else ""


def check_adapter(offered: AdapterSpec | None, served: AdapterSpec | None, version: int) -> None:
    """Check that a version's adapter fits the adapter an engine started with.

    Args:
        offered: the manifest's `adapter` (None: a full-weight version).
        served: the engine's adapter (None: the engine started without LoRA).
        version: named in the message.

    Alpha may differ (it only scales B A; the engine applies the offered one); rank and
    targets may not (the engine's adapter slots and its expected tensors are made for them).

    Raises:
        AdapterMismatch: an adapter offered to an engine without LoRA, full weights offered to
            an adapter-only engine, or a different rank or set of targets.
    """
    if offered is None and served is None:
        return
    if served is None:
        raise AdapterMismatch(
            f"version {version} is adapter-only (rank {offered.rank}), but this engine "  # type: ignore[union-attr]
            "started without LoRA: start it with a LoRA rank and targets, or push full weights"
        )
    if offered is None:
        raise AdapterMismatch(
            f"version {version} carries full weights, but this engine serves adapter-only "
            f"versions (rank {served.rank}, targets {list(served.targets)})"
        )
    if (offered.rank, offered.targets) != (served.rank, served.targets):
        raise AdapterMismatch(
            f"version {version}'s adapter (rank {offered.rank}, targets "
            f"{list(offered.targets)}) differs from the engine's (rank {served.rank}, "
            f"targets {list(served.targets)})"
        )
