"""What our vLLM worker classes add: registration of our transfer engine before the worker
is built, RPCs for the update path and the update's phase seconds, and the routed experts of
each request (routing replay: `rollout_engine.vllm.routes`).

vLLM spawns its workers, so a registration done in the front end does not reach them; the
classes in `workers_cpu.py` / `workers_gpu.py` call `register_transfer_engines()` first thing
in `__init__`. The backend passes the qualified name of the one matching the platform as
`worker_cls`. This module imports no vLLM worker class, so it loads on every platform.
"""

from __future__ import annotations

from typing import Any


class JaxrlWorkerMixin:
    """RPCs (called through `AsyncLLM.collective_rpc`) for refusing and aborting updates, for
    the seconds of the last one, and for recording and taking routed experts."""

    _jaxrl_routes: Any = None  # a routes.RouteRecorder once jaxrl_record_routes ran

    def execute_model(self, scheduler_output: Any) -> Any:
        """vLLM's step, with the routers recorded when `jaxrl_record_routes` ran."""
        recorder = self._jaxrl_routes
        if recorder is None:
            return super().execute_model(scheduler_output)  # type: ignore[misc]
        recorder.begin_step()
        out = super().execute_model(scheduler_output)  # type: ignore[misc]
        recorder.end_step(self.model_runner, scheduler_output.total_num_scheduled_tokens)  # type: ignore[attr-defined]
        return out

    def jaxrl_record_routes(self) -> tuple[int, int]:
        """Start recording every request's routed experts on TP rank 0 (the routers run
        replicated on every rank; the others record nothing). Returns (MoE layers, k).

        Raises:
            ValueError: a dense model, or MoE layers whose routing cannot be seen
                (`routes.RouteRecorder`).
        """
        from rollout_engine.vllm.routes import RouteRecorder

        recorder = RouteRecorder(self.model_runner.get_model())  # type: ignore[attr-defined]
        if self.rank == 0:  # type: ignore[attr-defined]
            self._jaxrl_routes = recorder
        return recorder.num_layers, recorder.top_k

    def jaxrl_take_routes(self, request_id: str) -> dict[str, tuple[bytes, list[int]]]:
        """Remove and return the routes of the worker requests of `request_id`: worker request
        id -> (int16 [R, L, k] as native-order bytes, [R, L, k]) ({} on ranks other than 0
        or when not recording). Bytes: vLLM's RPC reply turns arrays into nested lists."""
        if self._jaxrl_routes is None:
            return {}
        taken = self._jaxrl_routes.take(request_id)
        return {r: (a.tobytes(), list(a.shape)) for r, a in taken.items()}

    def jaxrl_held_routes(self) -> int:
        """Requests whose routes this worker holds (0 when not recording)."""
        return 0 if self._jaxrl_routes is None else self._jaxrl_routes.held_requests

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
