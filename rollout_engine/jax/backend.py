"""The JAX engine behind the rollout backend seam (`rollout_engine.backend.RolloutBackend`).

`generate` submits one group (G samples of one prompt) to the continuous batcher and awaits it;
a dispatcher task hands finished samples to their groups. Weights arrive either through the
data plane (`update_weights(manifest)`: HF-named tensors, mapped to JAX params by the family's
mapping; over jax_transfer they are pulled onto this engine's device and mapped there, with no
host copy, `transport.jax_transfer`; an engine on other devices of the trainer's host takes the
same path, device to device where the platform allows), then handed to the replicas as JAX
params (`update_params`). Each replica switches at its next safe point, and every sample
carries the version spans it was sampled with.

Temperature, top-k and top-p are values per slot (each request's own), so one engine serves
greedy evaluation and T=1 training; only whether a top-k / top-p filter exists at all is
compiled in (an engine started with one takes any values per request; one started without
refuses requests asking for one). The stop ids are compiled into the decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx
from pydantic import ConfigDict, Field

from gateway import messages as m
from rollout_engine.backend import RolloutBackend, UpdateStats, completion
from rollout_engine.config import JaxOptions
from rollout_engine.jax.batcher import BatcherConfig
from rollout_engine.jax.engine import EngineConfig, JaxEngine
from rollout_engine.jax.sampling import SamplingConfig as JaxSampling
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request, SampleResult
from transport.adapter_spec import check_adapter, served_adapter
from transport.base import TransferError
from transport.expected import checkpoint_tensors
from transport.jax_transfer import JaxTransferReceiver
from transport.manifest import Manifest, check_manifest


class JaxBackendConfig(JaxOptions):
    """How to start the JAX engine: the engine options (`rollout_engine.config.JaxOptions`,
    their one home) plus what the process decides.

    Attributes:
        model: HF checkpoint folder. dtype: compute and param dtype ("float32", "bfloat16").
        stop_token_ids: extra ids that end a sample besides the model's EOS ids.
        initial_version: the version the checkpoint counts as.
        lora_rank, lora_targets: with a rank > 0 the engine serves adapter-only versions
            (`sync.lora_only`) of exactly this rank and these PEFT targets, merged into its
            start checkpoint on load; 0 (default): full-weight versions only.

    Raises:
        pydantic.ValidationError: an option out of its range (see `JaxOptions`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    dtype: str = "float32"
    stop_token_ids: tuple[int, ...] = ()
    initial_version: int = 0
    lora_rank: int = Field(default=0, ge=0)
    lora_targets: tuple[str, ...] = ()


class JaxBackend(RolloutBackend):
    """`RolloutBackend` over :class:`JaxEngine` (see the module docstring)."""

    def __init__(self, cfg: JaxBackendConfig) -> None:
        self.cfg = cfg
        self.engine: JaxEngine | None = None
        self._expected = checkpoint_tensors(cfg.model, cfg.dtype)
        self._version: int | None = cfg.initial_version
        self._groups: dict[str, tuple[asyncio.Future, list[SampleResult | None], list[int]]] = {}
        self._ids = itertools.count()
        self._dispatcher: asyncio.Task | None = None
        self._receiver: Any = None
        self._model_cfg: Any = None
        self._decode: Callable[[list[int]], str] | None = None  # the tokenizer's, at start
        self.adapter = served_adapter(cfg.lora_rank, cfg.lora_targets)
        self._base: dict[str, Any] = {}  # the start checkpoint's flat params (adapter merges)
        self._served: nnx.State | None = None  # its state (adapter versions replace kernels)

    @property
    def weight_version(self) -> int | None:
        """The version handed to the engine last (served from each replica's next safe point)."""
        return self._version

    @property
    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (full shape, dtype) every manifest must list exactly."""
        return dict(self._expected)

    async def start(self) -> None:
        """Load the checkpoint, start the replicas and the dispatcher."""
        from models.checkpoints.hf_io import load_hf_checkpoint

        c = self.cfg
        model_cfg, model = await asyncio.to_thread(load_hf_checkpoint, c.model, dtype=c.dtype)
        self._model_cfg = model_cfg
        eos = tuple(dict.fromkeys((*model_cfg.eos_token_ids, *c.stop_token_ids)))
        if not eos:
            raise ValueError(f"{c.model} names no eos_token_id and no stop_token_ids were given")
        ecfg = EngineConfig(
            BatcherConfig(
                num_slots=c.num_slots,
                max_len=c.max_model_len,
                prefill_batch=c.prefill_batch,
                steps_per_call=c.steps_per_call,
                seed=c.seed,
                kv_bucket=c.kv_bucket,
                row_bucket=c.row_bucket,
                native_attention=c.native_attention,
                packed_weights=c.packed_weights,
                shared_prefix_min=c.shared_prefix_min,
                kv_cache_dtype=None if c.kv_cache_dtype == "auto" else c.kv_cache_dtype,
            ),
            JaxSampling(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p),
            StopConfig(eos_ids=(model_cfg.vocab_size,) if c.ignore_eos else eos, pad_id=eos[0]),
            replicas=c.replicas,
            devices_per_replica=c.devices_per_replica,
            tp=c.tp,
        )
        params = nnx.split(model)[1]
        if self.adapter is not None:  # every adapter version is merged into this base copy
            from models.checkpoints.peft_layout import adapter_shapes
            from models.params import flat_params

            self._base = flat_params(model)
            self._served = params  # the start checkpoint's state: the unadapted leaves
            shapes = adapter_shapes(model_cfg, self.adapter.targets, self.adapter.rank)
            self._expected = {n: (s, c.dtype) for n, s in shapes}
        tok = await asyncio.to_thread(_load_tokenizer, c.model)
        self._decode = None if tok is None else _decoder(tok)
        self.engine = JaxEngine(
            model_cfg, params, ecfg, version=c.initial_version, decode=self._decode
        )
        self._dispatcher = asyncio.create_task(self._dispatch())

    def _check_sampling(self, s: m.SamplingParams) -> None:
        c = self.cfg
        compiled = c.top_k > 0 or c.top_p < 1.0
        if not compiled and (s.top_k > 0 or s.top_p < 1.0):
            raise ValueError(
                f"the request asks for top_k={s.top_k}, top_p={s.top_p}; this JAX engine was "
                "started without a top-k / top-p filter (--jax-top-k / --jax-top-p), so its "
                "compiled sampler has none (temperature is free per request)"
            )
        if s.ignore_eos != c.ignore_eos:
            raise ValueError(
                f"the request asks for ignore_eos={s.ignore_eos}; this JAX engine was started "
                f"with ignore_eos={c.ignore_eos}, which is compiled in (not per request)"
            )
        extra = set(s.stop_token_ids) - set(self.engine.stops.eos_ids if self.engine else ())
        if extra:
            raise ValueError(
                f"stop ids {sorted(extra)} are not engine stop ids; set them in config"
            )

    async def generate(
        self, prompt: m.Prompt, stop_strings: Sequence[str] = ()
    ) -> tuple[m.Completion, ...]:
        """See `RolloutBackend.generate`. ``max_new_tokens`` counts every completion token.
        `stop_strings` end a sample in the engine: after each decode step the batcher matches
        the new token's text (`rollout_engine.jax.stop_strings`), the cut vLLM makes with
        ``include_stop_str_in_output``; finish reason "stop".

        Raises:
            ValueError: an empty prompt; sampling this engine cannot do; more than 16 stop
                strings, an empty one or one over 256 characters."""
        if self.engine is None:
            raise RuntimeError("the backend is not started")
        if self._version is None:
            raise RuntimeError("engine holds no whole weight version (a failed update)")
        if len(prompt.token_ids) == 0:
            raise ValueError(f"prompt {prompt.sample_id!r} is empty")
        s, g, version = prompt.sampling, prompt.group_size, self._version
        self._check_sampling(s)
        if s.return_routes and prompt.continues:
            raise ValueError(
                f"prompt {prompt.sample_id!r} asks for routes of a continued prompt (a later "
                "turn of an episode); the JAX engine records routes of whole prompts only"
            )
        key = f"{prompt.sample_id}#{next(self._ids)}"
        request = Request(
            key, tuple(int(t) for t in prompt.token_ids), g, s.max_new_tokens, s.seed,
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, continues=prompt.continues,
            stop_strings=tuple(stop_strings),
        )  # fmt: skip
        if stop_strings and self._decode is None:
            raise ValueError(
                f"prompt {prompt.sample_id!r} has stop strings but {self.cfg.model} has no "
                "tokenizer to match them with"
            )
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._groups[key] = (future, [None] * g, [g])
        try:
            self.engine.submit([request])
        except BaseException:
            self._groups.pop(key)
            raise
        samples: list[SampleResult] = await future
        return tuple(_completion(r, version, s.return_routes) for r in samples)

    async def _dispatch(self) -> None:
        assert self.engine is not None
        while True:
            try:
                results = await asyncio.to_thread(self.engine.poll, 0.05)
            except Exception as e:  # a replica failed: fail every waiting group
                for future, _, _ in self._groups.values():
                    if not future.done():
                        future.set_exception(e)
                self._groups.clear()
                return
            for r in results:
                entry = self._groups.get(str(r.prompt_id))
                if entry is None:
                    continue
                future, slots, left = entry
                slots[r.sample_index] = r
                left[0] -= 1
                if left[0] == 0:
                    self._groups.pop(str(r.prompt_id))
                    if not future.done():
                        future.set_result(slots)

    async def connect_transport(
        self, transport: dict[str, Any], rank_offset: int = 1, world_size: int | None = None
    ) -> None:
        """Join the data plane as receiver ``rank_offset`` of ``world_size`` (default 2)."""
        from pydantic import TypeAdapter

        from transport.config import TransportConfig
        from transport.factory import make_receiver

        cfg = TypeAdapter(TransportConfig).validate_python(transport)
        self._receiver = await asyncio.to_thread(make_receiver, cfg, rank_offset, world_size or 2)

    async def update_weights(self, manifest: Manifest) -> UpdateStats:
        """Receive HF-named tensors, map them to JAX params, hand them to every replica.

        Decoding goes on while the tensors arrive (the old params stay in use until the
        replicas' next safe point), so nothing pauses.

        Raises:
            ManifestError: the manifest does not fit the model (checked before any transfer;
                the engine keeps its version). TransferError: the transfer failed.
            RuntimeError: not started or no transport connected.
        """
        from mappings.apply import checkpoint_to_params
        from mappings.registry import get_family
        from models.params import model_from_params

        if self._receiver is None or self.engine is None:
            raise RuntimeError("call start() and connect_transport() before update_weights")
        t0 = time.perf_counter()
        try:
            check_adapter(manifest.adapter, self.adapter, manifest.version)
            check_manifest(manifest, self._expected)
        except ValueError as e:  # tell the sender, then raise the ManifestError itself
            with contextlib.suppress(TransferError):
                self._receiver.refuse(str(e))
            raise
        host: dict[str, Any] = {}
        if isinstance(self._receiver, JaxTransferReceiver):  # straight onto this device
            host = await asyncio.to_thread(self._receiver.pull, manifest)
        else:

            def on_bucket(bucket: list) -> None:
                import torch

                for name, tensor in bucket:  # the buffer is reused after the callback: copy
                    t = tensor.detach().to("cpu")  # once: the cast to fp32, or a clone
                    host[name] = (t.float() if t.dtype != torch.float32 else t.clone()).numpy()

            await asyncio.to_thread(self._receiver.receive, manifest, on_bucket)
        t1 = time.perf_counter()
        cfg = self._model_cfg
        target = jnp.dtype(cfg.param_dtype)  # bfloat16 too (ml_dtypes)
        family = get_family(cfg.family)
        loaded: dict[str, Any] = {}
        on_device = isinstance(self._receiver, JaxTransferReceiver)  # no host round trip
        if manifest.adapter is not None:  # W_base + (alpha / r) B A; the base copy is kept
            from models.checkpoints.peft_io import merge_peft
            from models.params import replace_params

            a = manifest.adapter
            assert self._served is not None  # set at start for an adapter engine
            merged = await asyncio.to_thread(
                merge_peft, self._base, cfg, host, a.targets, a.scaling, only_adapted=True
            )
            # only the adapted kernels are new: every other leaf of the served params is
            # shared (the engine keeps each array already in its replicas' layout)
            params = replace_params(self._served, merged)
        else:
            for rule, array in checkpoint_to_params(
                family, cfg, host.__getitem__, set(host), contiguous=not on_device
            ):  # host arrays stay on the host: the engine puts each into its replicas' layout
                loaded[rule.jax] = array.astype(target)
            params = nnx.split(model_from_params(cfg, loaded))[1]
        self.update_params(params, manifest.version)
        t2 = time.perf_counter()
        phases = {"transfer": t1 - t0, "load": t2 - t1, "total": t2 - t0}
        return UpdateStats(manifest.version, manifest.total_bytes, 0.0, t2 - t0, phases)

    def update_params(self, params: nnx.State, version: int) -> None:
        """Hand JAX params (``nnx.split(decoder)[1]``) of ``version`` to every replica (the
        last step of `update_weights`; also the way in for a caller holding the params)."""
        if self.engine is None:
            raise RuntimeError("the backend is not started")
        self.engine.update_weights(params, version)
        self._version = version

    async def shutdown(self) -> None:
        """Stop the dispatcher and the replicas."""
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            self._dispatcher = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None


def _completion(r: SampleResult, version: int, routes: bool = False) -> m.Completion:
    """Our record of one engine result (`version`: the one served when the request started;
    `routes`: the request asked for its routed experts, which a MoE model's result has)."""
    c = completion(
        r.tokens, r.logprobs, r.finish_reason, r.weight_versions, version, r.forced_positions
    )
    if routes and r.routes is not None:
        c = dataclasses.replace(c, routed_experts=r.routes)
    return c


def _load_tokenizer(path: str) -> Any:
    """The HF tokenizer of the checkpoint folder (or hub id) ``path``; None when it has none
    (then requests with stop strings are refused)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def _decoder(tok: Any) -> Callable[[list[int]], str]:
    """ids -> text with special tokens skipped: the decode `episode.cut_at_stop` is given."""

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=True))

    return decode
