"""The JAX rollout engine: replicas over device groups, each driven by its own thread.

After the seed write-up "Async RL in Pure JAX" (one replica per device group, one thread each,
no communication between replicas). Replicas pull whole requests from one shared inbox while
their own queue holds fewer samples than slots (work stealing, so a slow replica takes less);
each request's G samples stay on one replica and share one prefill. A replica of several
devices runs on a ("data", "tp") mesh (`rollout_engine.jax.tp`): its slots split over "data"
(see ``insert.sharded_scatter_rows``), its params placed by the trainer's logical-axis rules
(heads, KV heads, MLP width and vocab over "tp") and its KV cache split over the KV heads
(each KV head repeated tp / K times when the model has K < tp of them, as vLLM does).

Public API: ``JaxEngine(model_cfg, params, cfg)``, ``generate(requests) -> results``,
``submit`` / ``poll`` for streaming, ``update_weights(params, version)``, ``close()``.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Hashable, Sequence

import jax
from flax import nnx

from models.config import ModelConfig
from models.decoder import Decoder
from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stop_strings import Decode
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.tp import ReplicaLayout, place_params, replica_layout, replica_mesh
from rollout_engine.jax.types import Request, SampleResult


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Settings of the engine.

    Attributes:
        batcher: sizes of each replica (``num_slots`` counts all slots of a replica).
        sampling: temperature / top-k / top-p. stops: EOS ids, pad id, reasoning budget;
            ``None`` takes the model's ``eos_token_ids`` and pad 0.
        replicas: number of replicas (threads).
        devices_per_replica: devices of one replica; above 1 its slots shard over them.
        tp: tensor-parallel degree inside a replica (divides ``devices_per_replica``; the rest
            is the slots' "data" axis); 1 (default): params replicated, as before. A model
            with fewer KV heads than tp has each repeated tp / K times (`tp`).
        gather_s: seconds a replica with nothing in flight waits for each next request after
            the first of a burst before it starts decoding (0: it starts with what is already
            queued); requests that arrive later join only at its next decode call
            (``BatcherConfig.steps_per_call`` steps on), so a burst split there drifts apart.
    """

    batcher: BatcherConfig = dataclasses.field(default_factory=BatcherConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    stops: StopConfig | None = None
    replicas: int = 1
    devices_per_replica: int = 1
    tp: int = 1
    gather_s: float = 0.01


def decoder_graphdef(model_cfg: ModelConfig) -> nnx.GraphDef:
    """The graph definition of ``Decoder(model_cfg)``, built abstractly (no memory)."""
    abstract = nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)[0]


class JaxEngine:
    """Replicas of the continuous batcher behind one inbox and one outbox.

    Args:
        model_cfg: the model config. params: the ``nnx.State`` of a ``Decoder`` (``nnx.split``).
        cfg: engine settings. version: weight version of ``params``.
        devices: devices to use (default ``jax.devices()``); replica r takes
            ``devices[r·d : (r+1)·d]`` with ``d = cfg.devices_per_replica``.
        decode: token ids -> text, for requests with stop strings (`ContinuousBatcher`).

    Raises:
        ValueError: fewer devices than ``replicas · devices_per_replica``, a model with no
            EOS id while ``cfg.stops`` is None, or ``cfg.tp`` not dividing the replica's
            devices, the model's query heads, MLP width or vocab, or its KV heads K when
            K >= tp (K < tp: K must divide tp; checked before any replica starts,
            `models.sharding.MeshError` for the heads: `tp.check_replica_tp`).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        params: nnx.State,
        cfg: EngineConfig,
        *,
        version: int = 0,
        devices: Sequence[jax.Device] | None = None,
        decode: Decode | None = None,
    ):
        devices = list(devices if devices is not None else jax.devices())
        d, r = cfg.devices_per_replica, cfg.replicas
        if r < 1 or d < 1 or len(devices) < r * d:
            raise ValueError(
                f"{r} replicas of {d} devices need {r * d} devices, got {len(devices)}"
            )
        stops = cfg.stops
        if stops is None:
            if not model_cfg.eos_token_ids:
                raise ValueError("the model config has no eos_token_ids; pass EngineConfig.stops")
            stops = StopConfig(eos_ids=tuple(model_cfg.eos_token_ids))
        self.cfg, self.stops = cfg, stops
        meshes = [replica_mesh(devices[i * d : (i + 1) * d], cfg.tp) for i in range(r)]
        self._layouts: list[ReplicaLayout | jax.Device] = [
            replica_layout(model_cfg, mesh) if d > 1 else devices[i * d]
            for i, mesh in enumerate(meshes)
        ]
        # the model as a replica runs it: with KV heads repeated up to tp when fewer (`tp`)
        layout = self._layouts[0]
        run_cfg = layout.model_cfg if isinstance(layout, ReplicaLayout) else model_cfg
        graphdef = decoder_graphdef(run_cfg)
        self._batchers: list[ContinuousBatcher] = []
        for i, mesh in enumerate(meshes):
            self._batchers.append(
                ContinuousBatcher(
                    run_cfg,
                    graphdef,
                    place_params(params, self._layouts[i]),
                    cfg.batcher,
                    cfg.sampling,
                    stops,
                    mesh=mesh if d > 1 else None,
                    version=version,
                    replica=i,
                    decode=decode,
                )
            )
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._outbox: queue.Queue[SampleResult] = queue.Queue()
        self._stash: list[SampleResult] = []
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._run, args=(b,), name=f"jax-replica-{i}", daemon=True)
            for i, b in enumerate(self._batchers)
        ]
        for t in self._threads:
            t.start()

    @property
    def replicas(self) -> list[ContinuousBatcher]:
        """The replicas' batchers (for metrics: ``decode_steps``, ``prefiller.buckets``)."""
        return self._batchers

    def _run(self, batcher: ContinuousBatcher) -> None:
        try:
            while not self._stop.is_set():
                pulled: list[Request] = []
                want = batcher.cfg.num_slots - batcher.queued  # keep one slot-load queued
                idle = batcher.idle()
                while want > 0:
                    # an idle replica takes a burst whole (a group's episodes sending their
                    # next turns one by one): it waits up to gather_s for each next request
                    wait = (0.02 if not pulled else self.cfg.gather_s) if idle else 0.0
                    try:
                        r = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    pulled.append(r)
                    want -= r.num_samples
                if pulled:
                    batcher.submit(pulled)
                for result in batcher.step():
                    self._outbox.put(result)
        except BaseException as e:  # surfaced by generate/poll
            self._errors.append(e)
            self._stop.set()

    def _check(self) -> None:
        if self._errors:
            raise RuntimeError("a JAX engine replica failed") from self._errors[0]

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue requests; their samples come back through :meth:`poll` or :meth:`generate`.

        Raises:
            ValueError: a request too long for the slots (checked here, not in the thread).
        """
        self._check()
        limit = self.cfg.batcher.max_len
        for r in requests:
            if len(r.prompt) + r.max_new_tokens - 1 > limit:
                raise ValueError(
                    f"request {r.prompt_id!r} needs {len(r.prompt) + r.max_new_tokens - 1} "
                    f"positions, more than max_len={limit}"
                )
        for r in requests:
            self._inbox.put(r)

    def poll(self, timeout: float = 0.0) -> list[SampleResult]:
        """The samples finished so far (waits up to ``timeout`` seconds for the first one)."""
        self._check()
        out, self._stash = self._stash, []
        try:
            if not out and timeout > 0:
                out.append(self._outbox.get(timeout=timeout))
            while True:
                out.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        return out

    def generate(self, requests: Sequence[Request], timeout: float = 600.0) -> list[SampleResult]:
        """Complete ``requests`` and return their samples, ordered by request then sample index.

        Samples of other (streamed) requests that finish meanwhile are kept for :meth:`poll`.

        Raises:
            ValueError: duplicate prompt ids. TimeoutError: not done within ``timeout`` seconds.
        """
        ids = [r.prompt_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"prompt ids must be unique within a call, got {ids}")
        want: dict[tuple[Hashable, int], int] = {}
        for i, r in enumerate(requests):
            for g in range(r.num_samples):
                want[(r.prompt_id, g)] = i
        self.submit(requests)
        got: dict[tuple[Hashable, int], SampleResult] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(want):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(got)} of {len(want)} samples after {timeout} s")
            self._check()
            try:
                res = self._outbox.get(timeout=0.05)
            except queue.Empty:
                continue
            key = (res.prompt_id, res.sample_index)
            if key in want and key not in got:
                got[key] = res
            else:
                self._stash.append(res)
        return sorted(
            got.values(), key=lambda s: (want[(s.prompt_id, s.sample_index)], s.sample_index)
        )

    def update_weights(self, params: nnx.State, version: int) -> None:
        """Hand new weights to every replica; each switches at its next safe point.

        `params` are in the model's own layout (its K KV heads). Each tensor is put straight
        into the replica's layout (`tp.place_params`: a host array sends each device its own
        slice; k/v repeated first where the replica replicates KV heads); arrays already on
        a replica's devices with its sharding are referenced, not copied (``jax.device_put``
        to the same sharding returns the same buffers). Every replica's copy is placed before
        any replica gets one, so a refused tensor leaves every replica on its old version.

        Raises:
            KeyError, ValueError: a param the replicas lack, or a k/v tensor with neither the
                model's nor the replica's number of KV heads (`tp.place_params`, named).
        """
        placed = [place_params(params, layout) for layout in self._layouts]  # all, or none
        for batcher, replica_params in zip(self._batchers, placed, strict=True):
            batcher.update_weights(replica_params, version)

    def close(self) -> None:
        """Stop the replica threads (in-flight samples are dropped)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def __enter__(self) -> JaxEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
