"""Routed experts recorded on a vLLM worker (routing replay with vLLM on CPU).

Legend: n token rows of one step, E experts, k experts per token, L MoE layers, R rows of a
request (prompt + completion - 1).

vLLM's own `enable_return_routed_experts` needs its Model Runner V2 (Triton, absent on CPU).
This recorder does the same on the CPU runner: it wraps each fused-MoE layer's router
(`BaseRouter._compute_routing`, vLLM 0.32's `fused_moe/router/base_router.py`, which every
MoE layer's `_select_experts` calls on every forward) so that during a step each layer's
top-k ids [n, k] are kept, ordered as the JAX engine and `models.moe.route` order them (by
descending router logit, ties: lower expert id first; vLLM's CPU top-k is unsorted). When the
step's forward has run, the model runner's per-step input batch says which request and
position each of the n rows belongs to (`req_indices`, `positions`, `input_batch.req_ids`,
as vLLM's `_prepare_inputs` set them), and the rows go into that request's [R, L, k] array
at their positions, so a request whose KV was recomputed (a weight update with
`clear_cache`, a preemption) overwrites the rows it recomputed instead of adding rows.
A prompt row that came from the prefix cache would never run: the backend turns prefix
caching off for an engine that records routes.

Passes outside a step (vLLM's warm-up and profiling runs) are not recorded. The recorder is
installed by an RPC (`JaxrlWorkerMixin.jaxrl_record_routes`), never on import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

#: Most requests whose routes a worker holds at once; past it the oldest are dropped (a
#: request whose routes nobody fetched: its backend call was cancelled before it could free
#: them). The backend fetches and frees every request's routes as it ends.
MAX_HELD_REQUESTS = 4096


def order_by_logit(router_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Top-k ids [n, k] reordered by descending router logit, ties by ascending id (the order
    of `jax.lax.top_k` in `models.moe.route`). router_logits: [n, E] any float dtype.
    Returns int16 [n, k] on the CPU."""
    ids = ids.to(torch.int64)
    ascending, _ = torch.sort(ids, dim=-1)
    picked = torch.gather(router_logits.float(), -1, ascending)  # [n, k]
    _, order = torch.sort(picked, dim=-1, descending=True, stable=True)
    return torch.gather(ascending, -1, order).to(torch.int16).cpu()


def _moe_routers(model: torch.nn.Module) -> list[Any]:
    """The routers of the model's fused-MoE layers, by layer index.

    Raises:
        ValueError: no MoE layer (a dense model), or a layer whose routing the recorder
            cannot see (a monolithic kernel that routes inside itself).
    """
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    found: list[tuple[int, Any]] = []
    for module in model.modules():
        if not isinstance(module, MoERunner):
            continue
        if module._quant_method.is_monolithic or not isinstance(module.router, BaseRouter):
            raise ValueError(
                f"MoE layer {module.layer_id}: its kernel routes inside itself "
                f"({type(module._quant_method).__name__}); its routes cannot be recorded"
            )
        found.append((int(module.layer_id), module.router))
    if not found:
        raise ValueError("the model has no mixture-of-experts layer: it has no routes to record")
    return [router for _, router in sorted(found, key=lambda p: p[0])]


class RouteRecorder:
    """Per-request routed experts of one worker (module docstring).

    Attributes:
        num_layers: L, the MoE layers recorded. top_k: k.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        routers = _moe_routers(model)
        self.num_layers = len(routers)
        self.top_k = int(routers[0].top_k)
        self._step: list[torch.Tensor | None] | None = None
        self._held: dict[str, np.ndarray] = {}  # request id -> int16 [capacity, L, k]
        self._rows: dict[str, int] = {}  # request id -> rows written (highest position + 1)
        for slot, router in enumerate(routers):
            router._compute_routing = self._wrap(slot, router._compute_routing)

    def _wrap(self, slot: int, compute: Callable[..., Any]) -> Callable[..., Any]:
        def compute_and_record(
            hidden_states: torch.Tensor,
            router_logits: torch.Tensor,
            indices_type: torch.dtype | None,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            weights, ids = compute(hidden_states, router_logits, indices_type, **kwargs)
            if self._step is not None:
                self._step[slot] = order_by_logit(router_logits, ids)
            return weights, ids

        return compute_and_record

    def begin_step(self) -> None:
        """Record the routers of the forward pass about to run."""
        self._step = [None] * self.num_layers

    def end_step(self, runner: Any, num_tokens: int) -> None:
        """File the step's rows under their requests, from the runner's input batch.

        Args:
            runner: vLLM's model runner after `execute_model` (its `req_indices`, `positions`
                and `input_batch.req_ids` describe the step's rows).
            num_tokens: the step's scheduled tokens (rows past it are padding).

        Raises:
            RuntimeError: some MoE layers ran over the step and others did not.
        """
        step, self._step = self._step, None
        if step is None or num_tokens == 0 or all(s is None for s in step):
            return  # no forward pass this step
        if any(s is None for s in step):
            missing = [i for i, s in enumerate(step) if s is None]
            raise RuntimeError(f"MoE layers {missing} recorded no routes in this step")
        ids = torch.stack([s[:num_tokens] for s in step if s is not None], dim=1).numpy()
        req_index = np.asarray(runner.req_indices.np[:num_tokens])  # [n]
        positions = runner.positions[:num_tokens].cpu().numpy().astype(np.int64)  # [n]
        req_ids = runner.input_batch.req_ids
        for r in np.unique(req_index):
            rows = req_index == r
            self._put(str(req_ids[int(r)]), positions[rows], ids[rows])

    def _put(self, req_id: str, positions: np.ndarray, ids: np.ndarray) -> None:
        held = self._held.get(req_id)
        need = int(positions.max()) + 1
        if held is None or held.shape[0] < need:
            grown = np.full((max(need, 2 * (0 if held is None else held.shape[0])),
                             self.num_layers, self.top_k), -1, np.int16)  # fmt: skip
            if held is not None:
                grown[: held.shape[0]] = held
            held = self._held[req_id] = grown
            while len(self._held) > MAX_HELD_REQUESTS:
                oldest = next(iter(self._held))
                del self._held[oldest], self._rows[oldest]
        held[positions] = ids
        self._rows[req_id] = max(self._rows.get(req_id, 0), need)

    def take(self, request_id: str) -> dict[str, np.ndarray]:
        """Remove and return the routes of every worker request whose id contains
        `request_id` (vLLM adds a suffix, and a child of an n > 1 request a prefix).

        Returns:
            worker request id -> int16 [R, L, k] (R the rows written), maybe empty.
        """
        mine = [r for r in self._held if request_id in r]
        out = {r: self._held.pop(r)[: self._rows.pop(r)] for r in mine}
        return out

    @property
    def held_requests(self) -> int:
        """Requests whose routes this worker holds."""
        return len(self._held)
