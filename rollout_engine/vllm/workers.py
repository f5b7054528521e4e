"""What our vLLM worker classes add: registration of our transfer engine before the worker
is built, and two RPCs for the update path.

vLLM spawns its workers, so a registration done in the front end does not reach them; the
classes in `workers_cpu.py` / `workers_gpu.py` call `register_transfer_engines()` first thing
in `__init__`. The backend passes the qualified name of the one matching the platform as
`worker_cls`. This module imports no vLLM worker class, so it loads on every platform.
"""

from __future__ import annotations

from typing import Any


class JaxrlWorkerMixin:
    """RPCs (called through `AsyncLLM.collective_rpc`) for refusing and aborting updates."""

    def jaxrl_refuse_update(self, manifest: dict[str, Any], reason: str) -> str:
        """Make the sender fail fast: join the offer and vote no. Returns the reason."""
        from transport.base import TransferError

        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        try:
            engine.refuse(manifest, reason)
        except TransferError:
            pass  # a refusal always raises on this side; the sender has been told
        return reason

    def jaxrl_abort_update(self) -> int:
        """Finalize a failed update session; returns how many buckets it had loaded.

        Layers that received nothing get their previous tensors back, so with 0 buckets
        loaded the model holds its previous version whole; otherwise it is a mix.
        """
        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        engine.finish_weight_update()
        engine.reset_weight_update_target()
        self._weight_update_active = False
        return int(engine.buckets_loaded)
