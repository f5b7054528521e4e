"""What our vLLM worker classes add: registration of our transfer engine before the worker
is built, RPCs for the update path and the update's phase seconds.

vLLM spawns its workers, so a registration done in the front end does not reach them; the
classes in `workers_cpu.py` / `workers_gpu.py` call `register_transfer_engines()` first thing
in `__init__`. The backend passes the qualified name of the one matching the platform as
`worker_cls`. This module imports no vLLM worker class, so it loads on every platform.
"""

from __future__ import annotations

from typing import Any


class JaxrlWorkerMixin:
    """RPCs (called through `AsyncLLM.collective_rpc`) for refusing and aborting updates and
    for the seconds of the last one."""

    def jaxrl_update_phases(self) -> dict[str, float]:
        """The last update's seconds by phase on this worker: "start_s", "finish_s" (vLLM's
        layerwise reload set up and finalized) and the receiver's (`transport.collective.
        CollectiveReceiver`: "wait_s", "copy_s", "load_s", "commit_s")."""
        return dict(self.weight_transfer_engine.phases)  # type: ignore[attr-defined]

    def jaxrl_load_floor(self) -> float:
        """Seconds of vLLM's load of the checkpoint's tensors from memory on this worker
        (`JaxrlWeightTransferEngine.load_floor`); the engine must be paused."""
        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        cfg = engine.model_config
        return float(engine.load_floor(cfg.model, cfg.dtype))

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
