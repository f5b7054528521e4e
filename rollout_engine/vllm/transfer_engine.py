"""The worker side of our data plane inside vLLM: a `WeightTransferEngine` that receives a
version through any `gateway.transport` receiver and loads it with vLLM's layerwise reload.

Imported only inside vLLM worker processes, lazily, by the factory entry `registry.py` adds.
Each tensor-parallel worker is one receiver of the group (rank `rank_offset + tp_rank`) and gets
full HF-named tensors; the model's own `load_weights` fuses q/k/v and gate/up and takes its
shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import TypeAdapter
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from gateway.transport.base import WeightReceiver
from gateway.transport.config import TransportConfig
from gateway.transport.factory import make_receiver
from gateway.transport.manifest import Manifest


@dataclass
class JaxrlInitInfo(WeightTransferInitInfo):
    """Where to join the data plane.

    Attributes:
        transport: a `TransportConfig` as a dict (`kind` = gloo | nccl | file, ...).
        rank_offset: group rank of this engine's tensor-parallel rank 0 (>= 1).
        world_size: group size (1 sender + every receiving worker).
    """

    transport: dict[str, Any] = field(default_factory=dict)
    rank_offset: int = 1
    world_size: int = 2


@dataclass
class JaxrlUpdateInfo(WeightTransferUpdateInfo):
    """One version: `manifest` is `Manifest.to_dict()`."""

    manifest: dict[str, Any] = field(default_factory=dict)


class JaxrlWeightTransferEngine(WeightTransferEngine[JaxrlInitInfo, JaxrlUpdateInfo]):
    """Receives buckets through a `gateway.transport` receiver into the model's loaders."""

    init_info_cls = JaxrlInitInfo
    update_info_cls = JaxrlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: WeightReceiver | None = None
        self.buckets_loaded = 0  # buckets loaded in the current update session

    def init_transfer_engine(self, init_info: JaxrlInitInfo) -> None:
        """Join the group (blocks until the sender and every worker joined, or timeout)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        cfg = TypeAdapter(TransportConfig).validate_python(init_info.transport)
        if getattr(cfg, "kind", None) == "nccl":
            cfg = cfg.model_copy(update={"device": str(self.device)})
        rank = init_info.rank_offset + get_tensor_model_parallel_rank()
        self.receiver = make_receiver(cfg, rank=rank, world_size=init_info.world_size)
        connect = getattr(self.receiver, "connect", None)
        if connect is not None:
            connect()

    def start_weight_update(self) -> None:
        """Put the layers in layerwise-reload mode (each layer swaps when complete)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.buckets_loaded = 0
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """Finalize the layerwise reload (layers that got nothing keep their tensors), then
        re-process tied embedding layers (see `_reprocess_tied_embeddings`)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        _reprocess_tied_embeddings(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one version (or refuse it); no device sync needed on CPU."""
        info = self.parse_update_info(update_info)
        self.receive_weights(info)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: JaxrlUpdateInfo) -> None:
        """Receive every bucket of the version and hand it to `model.load_weights`."""
        if self.receiver is None:
            raise RuntimeError("init_weight_transfer_engine was not called")
        manifest = Manifest.from_dict(update_info.manifest)

        def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            self.buckets_loaded += 1
            self.model.load_weights(bucket)  # type: ignore[operator]

        self.receiver.receive(manifest, load)

    def refuse(self, manifest: dict[str, Any], reason: str) -> None:
        """Tell the sender this worker turns the version down (outside an update session)."""
        if self.receiver is None:
            raise RuntimeError("init_weight_transfer_engine was not called")
        self.receiver.refuse(reason)

    def shutdown(self) -> None:
        """Leave the group."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


def _reprocess_tied_embeddings(model: torch.nn.Module) -> int:
    """Re-run weight post-processing on embedding/LM-head layers that share their weight.

    With tied embeddings the LM head receives no tensor of its own (the checkpoint has none),
    so the layerwise reload leaves it unprocessed: on CPU its pre-packed GEMM weight keeps the
    old values while `embed_tokens` gets the new ones (measured: outputs then equal "new body,
    old head"). Re-processing every unquantized embedding layer whose weight storage is shared
    rebuilds those derived tensors from the new weight.

    Returns:
        The number of layers re-processed.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    by_storage: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        w = module._parameters.get("weight")
        if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod) and (
            w is not None and not w.is_meta
        ):
            by_storage.setdefault(w.untyped_storage().data_ptr(), []).append(module)
    n = 0
    for modules in by_storage.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)  # type: ignore
                n += 1
    return n
