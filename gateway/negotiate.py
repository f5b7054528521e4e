"""Registration: check an engine's request and agree the run settings with it, or refuse.

Malformed requests raise INVALID_ARGUMENT; a well-formed engine that cannot serve the run
(wrong family, dtype, backend or transport) is refused with a reason, not an error.
"""

from __future__ import annotations

import dataclasses

from gateway.errors import invalid, shown
from gateway.validate import check_id
from protos import gateway_pb2 as gpb


@dataclasses.dataclass(frozen=True)
class Decision:
    """The outcome of a registration.

    Attributes:
        settings: the agreed settings (valid when `refusal` is empty).
        refusal: why the engine was refused; empty when accepted.
        retry: the refusal may clear by itself (the run is not configured yet).
    """

    settings: gpb.RunSettings
    refusal: str = ""
    retry: bool = False


def check_register(req: gpb.RegisterRequest, current_version: int) -> None:
    """Raise INVALID_ARGUMENT for a malformed registration (missing or impossible fields)."""
    check_id("backend", req.backend)
    check_id("model_family", req.model_family)
    check_id("dtype", req.dtype)
    if req.device_count < 1:
        raise invalid(f"device_count: expected >= 1, got {req.device_count}")
    if req.tp_size < 1 or req.device_count % req.tp_size:
        raise invalid(
            f"tp_size: expected >= 1 and dividing device_count={req.device_count}, "
            f"got {req.tp_size}"
        )
    if not req.transports or not all(req.transports):
        raise invalid(f"transports: expected non-empty names, got {shown(list(req.transports))}")
    if not 0 <= req.weight_version <= current_version:
        raise invalid(
            f"weight_version: expected 0..{current_version} (the current version), "
            f"got {req.weight_version}"
        )


def negotiate(run: gpb.RunSettings, req: gpb.RegisterRequest) -> Decision:
    """Agree settings between the run (as configured by the trainer) and an engine.

    Family and dtype must match where the run has decided them; the backend must be
    allowed; the transport is the run's, which the engine must support, or else the
    engine's first choice. Mapping defaults to the family's name.
    """
    agreed = gpb.RunSettings()
    agreed.CopyFrom(run)
    if not run.model_family:
        return Decision(
            agreed, "the trainer has not configured the run yet (model family unknown)", True
        )
    if req.model_family != run.model_family:
        return Decision(
            agreed,
            f"model family differs: the trainer's model is {shown(run.model_family)}, "
            f"the engine serves {shown(req.model_family)}",
        )
    if run.dtype and req.dtype != run.dtype:
        return Decision(
            agreed,
            f"dtype differs: the run uses {shown(run.dtype)}, the engine serves {shown(req.dtype)}",
        )
    if run.backends and req.backend not in run.backends:
        return Decision(
            agreed,
            f"backend not allowed: the run allows {shown(list(run.backends))}, "
            f"the engine is {shown(req.backend)}",
        )
    if run.transport and run.transport not in req.transports:
        return Decision(
            agreed,
            f"transport unsupported: the run moves weights over {shown(run.transport)}, "
            f"the engine supports {shown(list(req.transports))}",
        )
    if run.adapter != req.adapter:
        run_takes = f"adapter-only versions of {shown(run.adapter)}" if run.adapter else (
            "full-weight versions"
        )  # fmt: skip
        engine_takes = f"adapter-only versions of {shown(req.adapter)}" if req.adapter else (
            "full-weight versions only (started without LoRA)"
        )  # fmt: skip
        return Decision(
            agreed, f"adapter differs: the run pushes {run_takes}, the engine takes {engine_takes}"
        )
    agreed.dtype = run.dtype or req.dtype
    agreed.transport = run.transport or req.transports[0]
    agreed.mapping = run.mapping or run.model_family
    return Decision(agreed)
