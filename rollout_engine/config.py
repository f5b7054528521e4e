"""Settings of one rollout engine process: the worker loop, the backend and the gateway.

Imports no ML library (pydantic, and the family registry of `mappings`), so `python -m
rollout_engine --help` answers at once and a launcher can validate an engine's config before
anything heavy starts. `VllmOptions` and `JaxOptions` are the one home of the backends'
options: `VllmBackendConfig` and `JaxBackendConfig` extend them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mappings.registry import family_for_model_type
from mappings.spec import MappingError


class WorkerConfig(BaseModel):
    """How the worker loop paces leases, returns and syncs (seconds unless said)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    max_concurrent_prompts: int = Field(default=16, ge=1)
    """Prompts (groups) in flight in the backend at once; leasing stops at this many."""
    lease_batch: int = Field(default=8, ge=1)
    """Most prompts asked for in one lease call."""
    lease_wait_s: float = Field(default=1.0, gt=0)
    """Long-poll wait of one lease call; bounds how late a stop is noticed by the lease loop."""
    register_wait_s: float = Field(default=60.0, ge=0)
    """How long to keep retrying a registration the gateway may accept later (run not
    configured yet)."""
    gateway_retry_s: float = Field(default=30.0, gt=0)
    """A gateway unreachable for this long counts as lost (the worker ends, and the engine
    registers again for up to `rejoin_s`)."""
    rejoin_s: float = Field(default=300.0, ge=0)
    """After the gateway dropped the engine or stayed unreachable past `gateway_retry_s`,
    keep trying to register again for this many seconds (`rollout_engine.rejoin`); past it
    the process exits with status 3. 0: exit at once (status 1)."""
    connect_timeout_s: float = Field(default=300.0, gt=0)
    """Joining the data plane (the rendezvous with the trainer's sender)."""
    update_timeout_s: float = Field(default=600.0, gt=0)
    """Receiving and loading one weight version."""
    drain_s: float = Field(default=10.0, ge=0)
    """On a stop (SIGTERM), wait this long (at most `stop_s` less one second) for in-flight
    groups to finish and be returned; the rest are cancelled and go back to the queue when the
    engine deregisters."""
    stop_s: float = Field(default=4.0, gt=0)
    """The whole stop after SIGTERM (drain, return, deregister) ends within this many seconds,
    whatever the gateway's state: a gateway that is gone or hung is not retried past it."""
    watch_interval_s: float = Field(default=0.25, gt=0)
    """How often the watchdog looks at the heartbeat (gateway shutdown, lost gateway)."""


class VllmOptions(BaseModel):
    """vLLM backend settings (see rollout_engine.vllm.backend.VllmBackendConfig)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    tensor_parallel_size: int = Field(default=1, ge=1)
    max_model_len: int = Field(default=2048, ge=2)
    kv_cache_gib: int = Field(default=1, ge=1)
    block_size: int = Field(default=0, ge=0)
    """Tokens per KV cache block; 0 keeps vLLM's own (128 on CPU, 16 on GPU). vLLM's prefix
    cache holds whole blocks only, so a multi-turn episode's history is found again only up
    to its last whole block: 32 keeps more of a short history than 128 (`docs/multi_turn.md`).
    On CPU a multiple of 32 keeps vLLM's fast attention kernel."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1)
    seed: int = 0
    return_routes: bool = False
    """Record the experts every MoE layer routes each token to (routing replay), returned for
    prompts that ask (`SamplingParams.return_routes`). Turns vLLM's prefix caching off for
    the engine (a prompt row served from the cache would never run its routers); refused for
    a dense model."""
    shutdown_s: float = Field(default=1.0, ge=0)
    """Seconds vLLM's engine-core process gets to exit after the engine stops before it is
    killed (vLLM's own default, 5 s per process, made a SIGTERM take seconds past --stop-s
    even when idle on CPU)."""


class JaxOptions(BaseModel):
    """JAX backend settings (see rollout_engine.jax.backend.JaxBackendConfig). temperature,
    top_k and top_p are the engine's default sampling (top_k 0 and top_p 1 are off, as in
    `gateway.messages.SamplingParams`):
    requests carry their own values per slot, but whether a top-k / top-p filter exists at
    all is compiled in, so an engine started without one refuses a request that asks for it."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    num_slots: int = Field(default=32, ge=1)
    max_model_len: int = Field(default=2048, ge=2)
    prefill_batch: int = Field(default=8, ge=1)
    steps_per_call: int = Field(default=64, ge=1)
    kv_bucket: int = Field(default=128, ge=0)
    """Smallest decode attention bound in cache slots (0: attend to every slot)."""
    row_bucket: int = Field(default=16, ge=0)
    """Smallest decode row bound: a decode call computes the first `row_bucket * 2**k` slots
    that hold every occupied one (0: every slot, always)."""
    native_attention: bool = True
    """The native CPU kernels (built by g++ on first use) on a one-device replica: a decode
    step's attention over the bf16 (bits) KV cache (`models.kernels.decode_attention`) and
    the token embedding lookup of a bf16 table (`models.kernels.embed_rows`); false, or
    where they cannot be built: XLA's."""
    packed_weights: bool = True
    """With `native_attention`, in a bfloat16 engine where the native bf16 kernel runs
    (`models.kernels.bf16_matmul.available`): each attention and MLP projection and the LM
    head held a second time in that kernel's layout, packed once per weight version, so
    that decode skips packing them each call (`models.packed`; one more bf16 copy of those
    weights). False: packed per call."""
    shared_prefix_min: int = Field(default=16, ge=0)
    """The fewest tokens a prefix shared by the prompts of one prefill call must have to be
    prefilled once, each prompt then prefilling only the rest behind its KV (a chat
    template's system prompt; `BatcherConfig.shared_prefix_min`); 0: off."""
    kv_cache_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """The KV cache's dtype; auto: the engine dtype. A float32 engine with a bfloat16 cache
    keeps float32 matmuls (faster than bfloat16 ones on a CPU without bf16 instructions)
    and a cache of half the bytes, read by the native kernel; each key and value is
    rounded to bfloat16 once, when written (`BatcherConfig.kv_cache_dtype`)."""
    replicas: int = Field(default=1, ge=1)
    devices_per_replica: int = Field(default=1, ge=1)
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree inside a replica: must divide devices_per_replica (the rest of
    its devices split the slots) and the model's query heads, MLP width and vocab, and its KV
    heads K when K >= tp (K < tp: K must divide tp, and each KV head is held tp / K times, as
    vLLM does); params are placed by the trainer's logical-axis rules and the KV cache split
    over its heads (`rollout_engine.jax.tp`). 1 (default): params replicated on a replica's
    devices."""
    temperature: float = Field(default=1.0, ge=0)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int = 0
    ignore_eos: bool = False
    """Never stop a sample on EOS (benchmarks: every sample runs to its max_new_tokens); the
    engine then serves only requests that ask for it (`SamplingParams.ignore_eos`), since
    whether EOS stops a slot is compiled in."""

    @model_validator(mode="after")
    def _check_tp(self) -> JaxOptions:
        if self.devices_per_replica % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide devices_per_replica={self.devices_per_replica}"
            )
        return self


class EngineProcessConfig(BaseModel):
    """Everything `python -m rollout_engine` needs."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    backend: Literal["vllm", "jax"]
    """Which rollout backend serves the prompts."""
    gateway: str
    """The gateway's HOST:PORT."""
    token_file: Path
    """Token file with the `engine=` token (`python -m gateway make-tokens`)."""
    ca_file: Path | None = None
    """PEM certificate to trust; given, the connection uses TLS."""
    model: Path
    """HF checkpoint folder the engine starts from (weight version `initial_version`)."""
    family: str = ""
    """Model family; empty: read from the checkpoint's config.json `model_type`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Engine dtype (torch name); every weight update must arrive in it."""
    initial_version: int = Field(default=0, ge=0)
    """The weight version the checkpoint counts as."""
    lora_rank: int = Field(default=0, ge=0)
    """> 0: serve adapter-only versions (`sync.lora_only`) of this LoRA rank on the
    checkpoint as base; 0: full-weight versions only."""
    lora_targets: tuple[str, ...] = ()
    """With lora_rank: the adapted projections by PEFT name (q_proj, ..., down_proj)."""
    name: str = ""
    """Engine name shown in the gateway status (default: the backend)."""
    transports: tuple[str, ...] = ("gloo", "file", "shm", "delta_stream")
    """Data-plane kinds this engine can receive, preferred first."""
    log_level: str = "INFO"
    worker: WorkerConfig = WorkerConfig()
    vllm: VllmOptions = VllmOptions()
    jax: JaxOptions = JaxOptions()

    @model_validator(mode="after")
    def _check(self) -> EngineProcessConfig:
        if ":" not in self.gateway:
            raise ValueError(f"gateway: expected HOST:PORT, got {self.gateway!r}")
        if not self.model.is_dir():
            raise ValueError(f"model: expected an HF checkpoint folder, got {str(self.model)!r}")
        if not self.family:
            self.family = family_of(self.model)
        return self


def family_of(model_dir: Path) -> str:
    """Our family name for an HF checkpoint folder, from its config.json `model_type`.

    Raises:
        ValueError: no config.json, or a `model_type` no family covers.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir}: no config.json; pass --family")
    try:
        return family_for_model_type(json.loads(path.read_text()).get("model_type"))
    except MappingError as e:
        raise ValueError(f"{path}: {e}") from None
