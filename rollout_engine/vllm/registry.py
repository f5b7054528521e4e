"""Registration of our transfer engine in vLLM's `WeightTransferEngineFactory`.

Called explicitly: by the worker classes of `workers_cpu.py` / `workers_gpu.py` inside each
vLLM worker process, and by the backend in the front-end process. Importing this module
registers nothing.
"""

from __future__ import annotations

# The `WeightTransferConfig.backend` name our engine is registered under.
ENGINE_NAME = "jaxrl"


def register_transfer_engines() -> None:
    """Register `JaxrlWeightTransferEngine` under `ENGINE_NAME`; idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            ENGINE_NAME, "rollout_engine.vllm.transfer_engine", "JaxrlWeightTransferEngine"
        )
