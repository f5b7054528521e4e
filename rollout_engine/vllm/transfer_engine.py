"""The worker side of our data plane inside vLLM: a `WeightTransferEngine` that receives a
version through any `transport` receiver and loads it with vLLM's layerwise reload.

Imported only inside vLLM worker processes, lazily, by the factory entry `registry.py` adds.
Each tensor-parallel worker is one receiver of the group (rank `rank_offset + tp_rank`) and
hands HF-named tensors to the model's own `load_weights`, which fuses q/k/v and gate/up and
takes this rank's shard. With a sharded manifest (`Manifest.tp_size` > 1) the worker receives
only its own region of each sharded tensor (`mappings.shards.tp_slice`, checked
against vLLM's loaders in the tests) and `_as_full` places it where the loader reads it, so
vLLM's loaders still do the fusing, vocab padding and CPU weight re-packing.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import TypeAdapter
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from transport.base import TransferError, WeightReceiver
from transport.config import TransportConfig
from transport.factory import make_receiver
from transport.manifest import Manifest, ManifestError
from transport.reshard import tp_rank_of


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
    """Receives buckets through a `transport` receiver into the model's loaders."""

    init_info_cls = JaxrlInitInfo
    update_info_cls = JaxrlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: WeightReceiver | None = None
        self.buckets_loaded = 0  # buckets loaded in the current update session
        self.phases: dict[str, float] = {}  # the last update's seconds by phase (`phases`)

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
        t0 = time.perf_counter()
        _reprocess_cpu_moe_experts_on_update(self.model)
        initialize_layerwise_reload(self.model)
        self.phases = {"start_s": time.perf_counter() - t0}

    def finish_weight_update(self) -> None:
        """Finalize the layerwise reload (layers that got nothing keep their tensors), then
        re-process tied embedding layers (see `_reprocess_tied_embeddings`)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0 = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        _reprocess_tied_embeddings(self.model)
        self.phases["finish_s"] = time.perf_counter() - t0

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one version (or refuse it); no device sync needed on CPU."""
        info = self.parse_update_info(update_info)
        self.receive_weights(info)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: JaxrlUpdateInfo) -> None:
        """Receive every bucket of the version and hand it to `model.load_weights`.

        Raises:
            ManifestError: a manifest sharded for another TP degree than this engine's, or a
                data-plane rank that would receive another TP rank's shards (voted down on the
                data plane first, so the sender fails at once).
            TransferError: the transfer failed (see `WeightReceiver.receive`).
        """
        if self.receiver is None:
            raise RuntimeError("init_weight_transfer_engine was not called")
        manifest = Manifest.from_dict(update_info.manifest)

        if manifest.sharded:
            from vllm.distributed import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            tp, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
            group_rank = getattr(self.receiver, "rank", None)
            reason = ""
            if manifest.tp_size != tp:
                reason = (
                    f"version {manifest.version} is sharded for tp_size {manifest.tp_size}, "
                    f"this engine runs tp_size {tp}"
                )
            elif group_rank is None or tp_rank_of(group_rank, tp, manifest.senders) != tp_rank:
                # the transport unpacks by group rank, vLLM loads by its own TP rank
                reason = (
                    f"version {manifest.version}: data-plane rank {group_rank} would receive "
                    f"the shards of another TP rank than this worker's {tp_rank} (expected a "
                    f"collective transport with rank_offset = {manifest.senders} mod {tp})"
                )
            if reason:
                # vote no on the data plane first: the group learns it now, not at its timeout
                with contextlib.suppress(TransferError):
                    self.receiver.refuse(reason)
                raise ManifestError(reason)
            index = {t.name: i for i, t in enumerate(manifest.tensors)}

        def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            self.buckets_loaded += 1
            if manifest.sharded:
                bucket = [(n, _as_full(manifest, index[n], tp_rank, t)) for n, t in bucket]
            self.model.load_weights(bucket)  # type: ignore[operator]

        self.receiver.receive(manifest, load)
        self.phases.update(getattr(self.receiver, "phases", {}))

    def load_floor(self, model_dir: str, dtype: torch.dtype, repeats: int = 3) -> float:
        """Seconds of vLLM's own load of the checkpoint's tensors, read from `model_dir`'s
        safetensors into memory first (not timed), as a push's update session runs it:
        start, `model.load_weights` of every tensor at once, finish; the median of
        `repeats` loads. The floor that any push pays on this engine; only for benchmarks
        (the engine must be paused)."""
        import statistics
        from pathlib import Path

        from safetensors.torch import load_file

        tensors = []
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            tensors += [(n, t.to(dtype)) for n, t in load_file(path).items()]
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.start_weight_update()
            self.model.load_weights(tensors)  # type: ignore[operator]
            self.finish_weight_update()
            seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds)

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


def _as_full(manifest: Manifest, i: int, tp_rank: int, part: torch.Tensor) -> torch.Tensor:
    """TP rank `tp_rank`'s region of tensor `i` as a tensor of the full shape that vLLM's
    weight loaders narrow to exactly that region (the other elements are left uninitialised:
    no loader of this rank reads them). A replicated tensor comes back as it is.

    The loaders of vLLM's linear layers (`weight_loader_v2`) always narrow the checkpoint
    tensor by the TP rank; handing them a full-shaped tensor keeps every loader path (fused
    q/k/v and gate/up, padded vocab shards, quantised or re-packed weights) vLLM's own, while
    only this rank's bytes crossed the wire. Costs one full-size allocation per tensor on this
    rank, freed once its layer is loaded.
    """
    spec = manifest.tensors[i]
    region = manifest.region(i, tp_rank)
    if tuple(part.shape) == spec.shape:
        return part
    full = torch.empty(spec.shape, dtype=part.dtype, device=part.device)
    full[region].copy_(part)
    return full


def _reprocess_tied_embeddings(model: torch.nn.Module) -> int:
    """Re-run weight post-processing on LM heads that share their weight with an embedding.

    With tied embeddings the LM head receives no tensor of its own (the checkpoint has none),
    so the layerwise reload leaves it unprocessed: on CPU its pre-packed GEMM weight keeps the
    old values while `embed_tokens` gets the new ones (measured: outputs then equal "new body,
    old head"). Re-processing each unquantized `ParallelLMHead` whose weight storage another
    embedding layer shares rebuilds those derived tensors from the new weight; the embedding
    itself received its tensor and was processed by the reload.

    Returns:
        The number of layers re-processed.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )

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
                if isinstance(module, ParallelLMHead):
                    module.quant_method.process_weights_after_loading(module)  # type: ignore
                    n += 1
    return n


def _reprocess_cpu_moe_experts_on_update(model: torch.nn.Module) -> int:
    """Make a weight update re-run the CPU fused-MoE experts' own post-load processing.

    vLLM 0.32's `UnquantizedFusedMoEMethod._setup_kernel` runs the experts kernel's
    `process_weights_after_loading` only on the first load; on a weight update (its
    `moe_kernel` already set) it skips it. On CPU that step zero-pads each expert's
    intermediate width to the kernel's alignment (`w13` [E, 2*I, H] -> [E, 2*I_pad, H],
    `w2` [E, H, I] -> [E, H, I_pad]) and pre-packs both into the grouped-GEMM layout, so an
    update without it either fails to copy into the padded tensors (Qwen3-MoE, I = 48 ->
    64: "size of tensor a (128) must match ... (96)") or copies raw rows into the pre-packed
    storage (OLMoE: wrong tokens, as vLLM's own `reload_weights` from a file). Wraps the
    method of each layer served by `CPUUnquantizedExperts` (once; idempotent) so that an
    update runs that step after vLLM's own copy, on the reload's materialised layer, before
    the layerwise reload copies the result into the live tensors.

    Returns:
        The number of MoE layers wrapped by this call (0 when already wrapped or no MoE).
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    n = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or "_jaxrl_moe" in vars(method):
            continue
        kernel = getattr(method, "moe_kernel", None)
        if kernel is None or not isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            continue
        original = method.process_weights_after_loading

        def process(layer: torch.nn.Module, _original=original, _method=method) -> None:
            update = _method.moe_kernel is not None
            _original(layer)
            if update:
                _method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process  # type: ignore[method-assign]
        method._jaxrl_moe = True  # type: ignore[attr-defined,assignment]
        n += 1
    return n
