"""`python benchmarks/weight_sync.py --lora RANK`: bytes and seconds of an adapter-only push
(`sync.lora_only`) against a full push of the merged model, into each engine, in one run.

For each engine (`--engines jax,vllm`), two engines in this process on the model's HF folder
(`--models`, the first one; SmolLM2-135M-Instruct by default) in `--dtype`: one started with
LoRA (`lora_rank` RANK on all seven projections), which takes adapter-only versions, and one
without, which takes the whole model. The trainer side is a `WeightPublisher` (with and without
`adapter`) sending through the shared-memory data plane (`transport.shm`, a segment under
/dev/shm per version) from a thread, while the engine's `update_weights` receives and loads:
the JAX engine merges each adapter into its start checkpoint (W + (alpha / r) B A) and hands
the whole model to its replicas; vLLM writes it as a PEFT folder and loads it as a new LoRA id
(`rollout_engine.vllm.adapters`); the plain engines load the full tensors (vLLM's layerwise
reload, paused; the JAX engine's mapping and hand-over). The adapter is non-zero (B drawn with
std 0.02). One warm-up push of each kind, then `--repeats` timed pushes; a push's seconds are
from the publisher's first offer to the engine's return from `update_weights` (the median).
Reference: the full push of the same engine measured in the same run; `bytes_ratio` and
`seconds_ratio` are adapter over full.

Measured 2026-12-04 on a shared 2-core AMD EPYC (avx2, avx512f, avx512_bf16), SmolLM2 bf16,
rank 8 on all seven projections, 3 pushes each: 4.88 MB against 269 MB (0.018); vLLM 0.090 s
against 1.28 s (0.070; `add_lora` of a new id 0.021 s, in-place reload 0.034 s); JAX engine
0.73 s against 1.04 s (0.70).

Imported by `weight_sync.py` (`python benchmarks/<name>.py` puts this folder first on
`sys.path`).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax
from common import CPU_ENV

from models.checkpoints.hf_io import load_hf_checkpoint
from models.lora import TARGETS, add_lora
from models.params import flat_params
from trainer.publish import WeightPublisher
from transport.adapter_spec import AdapterSpec
from transport.config import ShmTransportConfig
from transport.factory import make_sender

ALL = tuple(sorted(TARGETS))


def bench_lora(model_dir: Path, rank: int, engines: list[str], dtype: str, repeats: int) -> dict:
    """Adapter-only and full pushes into each engine of `engines` (see the module docstring);
    returns {engine: {"adapter": {...}, "full": {...}, "bytes_ratio", "seconds_ratio"}} with
    each kind's payload bytes, median seconds and every timed push's seconds."""
    cfg, model = load_hf_checkpoint(model_dir, dtype="float32")
    add_lora(model, rank, 2.0 * rank, ALL, jax.random.key(0), b_init_std=0.02)
    spec = AdapterSpec.of(rank, 2.0 * rank, ALL)
    out: dict[str, Any] = {}
    for engine in engines:
        row = {}
        for kind in ("adapter", "full"):
            row[kind] = asyncio.run(
                _pushes(engine, model_dir, cfg, model, spec if kind == "adapter" else None,
                        dtype, repeats)
            )  # fmt: skip
            print(f"{engine} {kind}: {row[kind]['bytes'] / 1e6:.2f} MB, "
                  f"{row[kind]['seconds']:.3f} s per push")  # fmt: skip
        row["bytes_ratio"] = row["adapter"]["bytes"] / row["full"]["bytes"]
        row["seconds_ratio"] = row["adapter"]["seconds"] / row["full"]["seconds"]
        out[engine] = row
    return out


def _backend(engine: str, model_dir: Path, dtype: str, spec: AdapterSpec | None):
    """An engine in this process; with `spec`, started with its rank and targets."""
    lora: dict[str, Any] = dict(lora_rank=spec.rank, lora_targets=spec.targets) if spec else {}
    if engine == "vllm":
        from rollout_engine.vllm.backend import VllmBackend, VllmBackendConfig

        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
        return VllmBackend(VllmBackendConfig(model=str(model_dir), dtype=dtype,  # type: ignore[arg-type]
                                             max_model_len=256, **lora))  # fmt: skip
    from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig

    return JaxBackend(
        JaxBackendConfig(model=str(model_dir), dtype=dtype, num_slots=4, max_model_len=256, **lora)
    )


async def _pushes(
    engine: str, model_dir: Path, cfg: Any, model: Any, spec: AdapterSpec | None,
    dtype: str, repeats: int,
) -> dict:  # fmt: skip
    """One engine, a warm-up push and `repeats` timed pushes of one kind."""
    backend = _backend(engine, model_dir, dtype, spec)
    root = tempfile.mkdtemp(prefix="jaxrl-lora-bench-", dir="/dev/shm")
    plane = ShmTransportConfig(root=root)
    publisher = WeightPublisher(None, plane, cfg.family, cfg, dtype, adapter=spec)  # type: ignore[arg-type]
    params = flat_params(model)
    if spec is None:
        from models.lora import engine_params

        params = engine_params(model)  # the merged model a full push carries
    sender = make_sender(plane)
    seconds, num_bytes, add_lora_s = [], 0, []
    try:
        await backend.start()
        await backend.connect_transport(plane.model_dump())
        for version in range(1, repeats + 2):
            manifest = publisher.manifest(version)
            items = publisher._engine_tensors(params)  # the publisher's own tensor stream
            t0 = time.perf_counter()
            thread = threading.Thread(target=sender.send, args=(manifest, items))
            thread.start()
            stats = await backend.update_weights(manifest)
            thread.join(600)
            if version > 1:
                seconds.append(time.perf_counter() - t0)
                if "add_lora_s" in stats.phases:
                    add_lora_s.append(stats.phases["add_lora_s"])
            num_bytes = manifest.total_bytes
        out: dict[str, Any] = {}
        if engine == "vllm" and spec is not None:  # the other way vLLM offers: same id
            out["new_id_add_lora_s"] = statistics.median(add_lora_s)
            out["in_place_add_lora_s"] = await _in_place(backend, model, cfg, spec, repeats)
    finally:
        await backend.shutdown()
        sender.close()
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return {"bytes": num_bytes, "seconds": statistics.median(seconds), "pushes_s": seconds, **out}


async def _in_place(backend: Any, model: Any, cfg: Any, spec: AdapterSpec, repeats: int) -> float:
    """Median seconds of vLLM's in-place reload of the current LoRA id (`LoRARequest(...,
    load_inplace=True)`) from a PEFT folder of the same adapter: what replacing the adapter
    under the same id would cost instead of `add_lora` of a new id. Not used by the engine:
    requests in flight would switch adapters mid-sample with no record of where."""
    from vllm.lora.request import LoRARequest

    from models.checkpoints.peft_io import save_peft_adapter

    current = backend._adapters.current
    times = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        folder = save_peft_adapter(model, Path(tmp) / "a")  # fp32; vLLM casts
        for _ in range(repeats):
            t0 = time.perf_counter()
            req = LoRARequest(
                current.lora_name, current.lora_int_id, str(folder), load_inplace=True
            )
            if not await backend.engine.add_lora(req):
                raise RuntimeError("vLLM refused the in-place reload")
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
