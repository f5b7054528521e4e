"""`CPUWorker` with our transfer engine registered (see `workers.py`)."""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from rollout_engine.vllm.registry import register_transfer_engines
from rollout_engine.vllm.workers import JaxrlWorkerMixin


class JaxrlCPUWorker(JaxrlWorkerMixin, CPUWorker):
    """vLLM's CPU worker, registering our transfer engine before it builds the model."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        register_transfer_engines()
        super().__init__(*args, **kwargs)
