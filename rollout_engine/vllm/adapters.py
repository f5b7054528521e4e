"""vLLM serving adapter-only versions (`sync.lora_only`): one LoRA id per weight version.

The engine starts with vLLM's LoRA support on (`enable_lora`, `max_lora_rank` the smallest of
vLLM's allowed ranks >= ours, `max_loras` 2: the version being served and the one before it
while its requests finish). A version arrives through the data plane into this process (the
backend's own receiver: the base weights never move, so vLLM's weight-transfer path is not
used), is written as a PEFT folder to a temporary folder (under /dev/shm when there is one)
and loaded with `AsyncLLM.add_lora(LoRARequest(name, id, folder))`, then the folder is
removed: vLLM 0.32 loads a LoRA only from a folder (its loader reads `adapter_config.json`
and the safetensors file; no API takes tensors from memory without reaching into its
workers' private adapter manager), so the copy through /dev/shm is the price of using it
unpatched.

Switching is atomic: requests that start after `install` returns use the new id; requests in
flight keep the id they started with (vLLM computes a request with one adapter), so each
sample is made by exactly one version and its version span is that version's. The old id is
removed (`remove_lora`) when its last request ends. No pause and no prefix-cache reset are
needed: vLLM's prefix-cache keys include the LoRA id.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.checkpoints.peft_layout import write_peft_folder
from transport.adapter_spec import AdapterSpec

#: The ranks vLLM 0.32 accepts as `max_lora_rank` (`vllm.config.lora.MaxLoRARanks`).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of `rank`.

    Raises:
        ValueError: `rank` above vLLM's largest (512).
    """
    for r in VLLM_MAX_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank (512)")


def lora_engine_args(spec: AdapterSpec) -> dict[str, Any]:
    """The `AsyncEngineArgs` fields of a LoRA engine for adapters of `spec` (their dtype
    vLLM's "auto": the model's, which every version's wire dtype is)."""
    return dict(
        enable_lora=True, max_lora_rank=max_lora_rank(spec.rank), max_loras=2, max_cpu_loras=4
    )


class AdapterVersions:
    """The LoRA id each new request uses, the versions' ids in flight, and their loading.

    Args:
        engine: vLLM's `AsyncLLM` started with `lora_engine_args`.
        base: the base checkpoint folder (recorded in each PEFT folder).
    """

    def __init__(self, engine: Any, base: str) -> None:
        self.engine = engine
        self.base = base
        self.current: Any = None  # the LoRARequest new requests use; None: the base alone
        self.version_of: dict[int, int] = {}  # LoRA id -> weight version
        self._in_flight: Counter[int] = Counter()
        self._lock = asyncio.Lock()

    def acquire(self) -> Any:
        """The LoRA request for a request starting now (None before the first adapter),
        counted in flight until `release`."""
        req = self.current
        if req is not None:
            self._in_flight[req.lora_int_id] += 1
        return req

    async def release(self, req: Any) -> None:
        """A request of `req` (from `acquire`) ended; drops an old id whose last one it was."""
        if req is None:
            return
        self._in_flight[req.lora_int_id] -= 1
        await self._drop_drained()

    async def install(
        self, version: int, tensors: Mapping[str, Any], spec: AdapterSpec
    ) -> dict[str, float]:
        """Load `tensors` (PEFT names, torch) of `version` as LoRA id version + 1 and make it
        the one new requests use; returns seconds by phase ("write_s", "add_lora_s").

        Raises:
            RuntimeError: vLLM refused the adapter (its reason in its log); the previous
                adapter stays current.
        """
        from vllm.lora.request import LoRARequest

        loop = asyncio.get_running_loop()
        async with self._lock:
            t0 = loop.time()
            root = "/dev/shm" if Path("/dev/shm").is_dir() else None
            folder = tempfile.mkdtemp(prefix=f"jaxrl-lora-v{version}-", dir=root)
            try:
                await asyncio.to_thread(
                    write_peft_folder, folder, tensors, spec.rank, spec.alpha, spec.targets,
                    base=self.base,
                )  # fmt: skip
                t1 = loop.time()
                req = LoRARequest(f"v{version}", version + 1, folder)
                if not await self.engine.add_lora(req):
                    raise RuntimeError(f"vLLM did not load the adapter of version {version}")
                t2 = loop.time()
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            self.version_of[req.lora_int_id] = version
            self.current = req
        await self._drop_drained()
        return {"write_s": t1 - t0, "add_lora_s": t2 - t1}

    async def _drop_drained(self) -> None:
        """Remove from vLLM every id that is not current and has no request in flight."""
        current = self.current.lora_int_id if self.current is not None else None
        for lora_id in [i for i in self.version_of if i != current and self._in_flight[i] <= 0]:
            del self.version_of[lora_id]
            self._in_flight.pop(lora_id, None)
            await self.engine.remove_lora(lora_id)

    async def loaded(self) -> set[int]:
        """The LoRA ids vLLM holds now (`list_loras`)."""
        return set(await self.engine.list_loras())
