"""Continuous batching on one replica: a queue of samples, B slots, prefill on demand.

The host side of the seed write-up "Async RL in Pure JAX" (``continuous_batch``), reorganised:
- samples wait in a FIFO queue; a prompt is prefilled (with up to ``prefill_batch`` next prompts,
  in one bucketed call; prompts prefilled at once in several calls go shortest first, so each
  call pads to a T bucket near its own prompts) when its first sample is about to enter a slot,
  and its prefill is dropped
  when its last sample entered or when the weights change, so every sample starts from a prefill
  made with the weights current at its insertion; requests of the same prompt prefilled
  together share one row (the G episodes of a group at their first turn);
- each :meth:`ContinuousBatcher.step` applies pending weights (a safe point), fills every free
  slot, runs the compiled decode loop until a slot finishes (or ``steps_per_call`` steps), and
  collects every finished slot at once; the in-flight slots carry over to the next call and to
  the next requests, so no straggler batch idles the device;
- slot memory: a collected slot remembers the tokens its KV cache holds (prompt and completion,
  when one weight version made them all, the current one) until it is reused or the weights
  change. A one-sample request that `continues` an earlier one (an episode's next turn) goes to
  the free slot holding the longest common prefix of its prompt and is prefilled from there
  (`extend.Extender`: only the new tokens run through the model); fresh samples take the free
  slots that remember nothing, or the least recently used, first.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.kernels import bf16_matmul
from models.packed import with_packed
from rollout_engine.jax.decode import make_decode_loop
from rollout_engine.jax.extend import Extender, common_prefix
from rollout_engine.jax.insert import make_insert
from rollout_engine.jax.prefill import (
    PrefillBatch,
    Prefiller,
    SharedPrefix,
    doubling_bound,
    next_pow2,
)
from rollout_engine.jax.sampling import RowSampling, SamplingConfig
from rollout_engine.jax.state import SlotState, init_slots
from rollout_engine.jax.stop_strings import Decode, StopStringMatcher
from rollout_engine.jax.stops import STOP_EOS, StopConfig
from rollout_engine.jax.tp import state_sharding
from rollout_engine.jax.types import FINISH_REASONS, Request, SampleResult

PREFIX_CACHE_ENTRIES = 8
"""Shared prefixes a batcher keeps the KV of (the least recently used dropped first)."""


@dataclasses.dataclass(frozen=True)
class BatcherConfig:
    """Sizes of one replica.

    Attributes:
        num_slots: B, samples decoded together (a multiple of the data-parallel device count).
        max_len: S, cache positions per slot: prompt plus ``max_new_tokens - 1`` must fit.
        prefill_batch: prompts prefilled together (padded to a power of two).
        steps_per_call: most decode steps between two safe points.
        min_prompt_bucket: smallest prompt length bucket.
        seed: base seed of the sample keys.
        kv_bucket: smallest attention bound in cache slots. Each decode call attends only
            to slots [0, kv_len), kv_len the smallest ``kv_bucket * 2**k`` that holds every
            running slot's position plus ``steps_per_call`` (capped at ``max_len``), so a step
            reads the KV the batch has used, not all S slots (one compiled loop per bound);
            0 always attends to all ``max_len`` slots.
        stop_string_steps: most decode steps between two stop-string checks while a slot whose
            request has stop strings runs (the check reads the new tokens to the host); 1
            samples no token past a stop, more trade up to ``n - 1`` dropped tokens per stop for
            fewer host round trips.
        row_bucket: smallest decode row bound. Each decode call computes only slots
            [0, rows), rows the smallest ``row_bucket * 2**k`` above every occupied slot
            (capped at ``num_slots``: one compiled loop per bound), and fresh samples take the
            lowest free slots, so fewer requests than slots (an evaluation's last prompts, a
            small batch) cost a smaller step; 0 always computes every slot. Off on a sharded
            replica.
        kv_bits: hold a bfloat16 KV cache as uint16 bit patterns, so that its writes (each
            decode step's, each insertion's) run in place on XLA's CPU backend instead of
            converting the whole cache to float32 and back (`models.kv_cache`; the same
            tokens and log-probs). None: on when every device of the replica is a CPU.
        native_attention: the native CPU kernels where they are built, off on a sharded
            replica: a decode step's attention over a bits cache
            (`models.kernels.decode_attention`: the visible slots read in place, no copy of
            the cache; the same values up to summation order) and the token embedding
            lookup of a bf16 table in prefill, extension and decode
            (`models.kernels.embed_rows`: the same values). False: XLA's paths.
        packed_weights: with `native_attention` and the native bf16 projection kernel
            (`models.kernels.bf16_matmul.available`) in a bfloat16 model, hold each
            attention and MLP projection and the LM head a second time in that kernel's operand
            layout, packed once per weight version (`models.packed`: when the replica gets
            the weights, in the caller's thread), so that decode's projections skip the
            packing each call does (the same values; the head's differ from XLA's dot in
            summation order). Costs one more bf16 copy of those weights. False: the kernel
            packs per call.
        shared_prefix_min: the fewest tokens a prefix shared by the prompts of one prefill
            call must have to be prefilled once: its KV is computed in one row (n0 rounded
            down to a multiple of 8, at most the shortest prompt's length - 1) and each prompt
            prefills only the rest behind it (`prefill.SharedPrefix`; vLLM's automatic prefix
            caching idea). A prefix stays cached for later calls (the last
            ``PREFIX_CACHE_ENTRIES``) until the weights change. The first 64 GSM8K prompts of
            the chat template share 24 of their 5,800 tokens' worth per prompt. 0: off; off
            on a sharded replica and for a mixture-of-experts model (routing replay records
            every prompt position's routes in the prompt's own prefill).
        kv_cache_dtype: the KV cache's dtype ("bfloat16" or "float32"), None: the model's
            compute dtype. A float32 model with a bfloat16 cache (vLLM's ``kv_cache_dtype``
            idea) keeps float32 matmuls, faster than bfloat16 ones on a CPU without bf16
            instructions, while the cache is half the bytes and, held as bits, read
            by the native kernel: each token's key and value are rounded to bfloat16 once,
            when written (the prefill attends to the rounded values too: `Prefiller`).
    """

    num_slots: int = 8
    max_len: int = 512
    prefill_batch: int = 4
    steps_per_call: int = 64
    min_prompt_bucket: int = 16
    seed: int = 0
    kv_bucket: int = 128
    stop_string_steps: int = 1
    row_bucket: int = 16
    kv_bits: bool | None = None
    native_attention: bool = True
    packed_weights: bool = True
    kv_cache_dtype: str | None = None
    shared_prefix_min: int = 16

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in (None, "bfloat16", "float32"):
            raise ValueError(
                f"kv_cache_dtype must be 'bfloat16', 'float32' or None, got {self.kv_cache_dtype!r}"
            )
        if self.stop_string_steps < 1:
            raise ValueError(f"stop_string_steps must be >= 1, got {self.stop_string_steps}")
        for name in ("kv_bucket", "row_bucket", "shared_prefix_min"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"{name} must be >= 0 (0 turns the bound off), got {getattr(self, name)}"
                )


@dataclasses.dataclass
class _Pending:
    request: Request
    index: int
    key_data: np.ndarray  # [2] uint32


@dataclasses.dataclass
class _Slot:
    request: Request
    index: int
    spans: list[tuple[int, int]]  # (version, first token index)
    prompt_routes: np.ndarray | None = None  # [P, L, k] the prefill's (MoE models)
    matcher: StopStringMatcher | None = None  # set when the request has stop strings


def sample_keys(seed: int, request: Request) -> np.ndarray:
    """``[G, 2]`` uint32 raw keys of a request's samples: ``fold_in(fold_in(key(seed), s), g)``."""
    base = jax.random.fold_in(jax.random.key(seed), request.seed_value)
    keys = jax.vmap(lambda g: jax.random.fold_in(base, g))(jnp.arange(request.num_samples))
    return np.asarray(jax.random.key_data(keys), np.uint32)


class ContinuousBatcher:
    """One replica's scheduler over its B slots. Not thread-safe: one thread drives it.

    Args:
        model_cfg: the model as this replica runs it (in the sharded mode
            `tp.ReplicaLayout.model_cfg`: KV heads repeated up to tp when the model has
            fewer; the KV cache's shape follows it). graphdef, params: ``nnx.split(decoder)``
            of that config; params already placed on the replica's devices (by
            `tp.place_params` on ``mesh`` in the sharded mode).
        cfg: sizes. sampling: the default of requests that set no temperature / top-k / top-p
            of their own (each slot samples with its request's; `sampling.truncates` compiles
            the top-k / top-p filters in). stops: static settings.
        mesh: for the sharded mode, the replica's ("data", "tp") mesh (`tp.replica_mesh`):
            slots shard over "data", the KV cache's heads over "tp".
        version: the weight version of ``params``. replica: index stamped on the results.
        decode: token ids -> text (special tokens skipped), for requests with stop strings.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        cfg: BatcherConfig,
        sampling: SamplingConfig,
        stops: StopConfig,
        *,
        mesh: jax.sharding.Mesh | None = None,
        version: int = 0,
        replica: int = 0,
        decode: Decode | None = None,
    ):
        if mesh is not None and cfg.num_slots % mesh.shape["data"]:
            raise ValueError(
                f"num_slots {cfg.num_slots} must be a multiple of the {mesh.shape['data']} "
                "devices the slots split over"
            )
        self.cfg, self.sampling, self.stops = cfg, sampling, stops
        self.params, self.version, self.replica = params, version, replica
        self._shares_prefixes = (
            cfg.shared_prefix_min > 0 and mesh is None and not model_cfg.num_experts
        )
        # shared prefix tokens -> their KV under the current weights (`_prefill_chunk`)
        self._prefix_kv: collections.OrderedDict[tuple[int, ...], SharedPrefix] = (
            collections.OrderedDict()
        )
        self.decode = decode
        self._pending_weights: tuple[nnx.State, int] | None = None
        self._weights_lock = threading.Lock()  # update_weights may come from another thread
        self.mesh = mesh
        repl = None if mesh is None else jax.NamedSharding(mesh, jax.sharding.PartitionSpec())
        leaf = jax.tree.leaves(params)[0]
        if mesh is not None:
            devices = list(mesh.devices.flat)
        elif isinstance(leaf, jax.Array):  # the replica's device is where its params are
            devices = [next(iter(leaf.devices()))]
        else:
            devices = jax.devices()[:1]
        kv_bits = cfg.kv_bits
        if kv_bits is None:
            kv_bits = all(d.platform == "cpu" for d in devices)
        native = cfg.native_attention and mesh is None
        self._plain_graphdef = graphdef  # what `update_weights`' params split from
        self._packs = (
            native and cfg.packed_weights and jnp.dtype(model_cfg.dtype) == jnp.bfloat16
            and bf16_matmul.available()
        )  # fmt: skip
        if self._packs:
            graphdef, self.params = with_packed(graphdef, params)
        self.prefiller = Prefiller(
            graphdef,
            model_cfg,
            pad_id=stops.pad_id,
            min_len=cfg.min_prompt_bucket,
            max_len=cfg.max_len,
            batch=cfg.prefill_batch,
            out_sharding=repl,
            cache_dtype=cfg.kv_cache_dtype,
            kv_bits=kv_bits,
            native=native,
        )
        self.extender = Extender(
            graphdef, model_cfg, pad_id=stops.pad_id, min_len=cfg.min_prompt_bucket,
            batch=cfg.prefill_batch, kv_bucket=cfg.kv_bucket, native=native,
        )  # fmt: skip
        self._loop = make_decode_loop(graphdef, sampling, stops, native_attention=native)
        self._insert = make_insert(
            capacity=cfg.max_len,
            marker_len=stops.marker_len,
            sampling=sampling,
            stops=stops,
            mesh=mesh,
        )
        state = init_slots(
            model_cfg,
            num_slots=cfg.num_slots,
            max_len=cfg.max_len,
            capacity=cfg.max_len,
            marker_len=stops.marker_len,
            pad_id=stops.pad_id,
            cache_dtype=cfg.kv_cache_dtype,
            kv_bits=kv_bits,
        )
        if mesh is not None:
            state = jax.device_put(state, state_sharding(state, mesh))
        elif isinstance(leaf, jax.Array):
            state = jax.device_put(state, devices[0])
        self.state: SlotState = state
        self._queue: collections.deque[_Pending] = collections.deque()
        self._prefills: dict[int, tuple[PrefillBatch, int]] = {}  # id(request) -> (batch, row)
        self._slots: list[_Slot | None] = [None] * cfg.num_slots
        # slot memory: the tokens a free slot's cache holds (all but the last cached) and when
        # it was last used; kept for one replica on one device (a sharded state is not read)
        self._memory: list[np.ndarray | None] = [None] * cfg.num_slots
        self._used = [0] * cfg.num_slots
        self._clock = 0
        self.decode_steps = 0
        self.prefilled_rows = 0
        """Prompt rows prefilled whole (requests of one prompt queued together share one)."""
        self.continued = 0
        """Samples continued in a slot's memory (extension prefill)."""
        self.reused_tokens = 0
        """Prompt tokens those continuations did not prefill again."""
        self.shared_prefix_tokens = 0
        """Prompt tokens prefilled behind a shared prefix instead of in their own rows."""
        self.prefixes_prefilled = 0
        """Shared prefixes computed (each in one row)."""

    # ---- queue -----------------------------------------------------------------------------
    def submit(self, requests: Sequence[Request]) -> None:
        """Queue every sample of ``requests``.

        Raises:
            ValueError: a prompt plus ``max_new_tokens - 1`` longer than ``max_len``; a request
                asking for top-k / top-p from an engine started without them (compiled out);
                a request with stop strings to a batcher given no ``decode``.
        """
        for r in requests:
            if r.stop_strings and self.decode is None:
                raise ValueError(
                    f"request {r.prompt_id!r} has stop strings but this engine was given no "
                    "decode function (token ids -> text) to match them with"
                )
            need = len(r.prompt) + r.max_new_tokens - 1
            if need > self.cfg.max_len:
                raise ValueError(
                    f"request {r.prompt_id!r} needs {need} positions (prompt {len(r.prompt)} + "
                    f"max_new_tokens {r.max_new_tokens} - 1), more than max_len={self.cfg.max_len}"
                )
            if not self.sampling.truncates and self.sampling_of(r).truncates:
                raise ValueError(
                    f"request {r.prompt_id!r} asks for top_k={r.top_k}, top_p={r.top_p}: this "
                    "engine was started without a top-k / top-p filter (compiled out); start it "
                    "with one (any values then go per request)"
                )
        for r in requests:
            keys = sample_keys(self.cfg.seed, r)
            self._queue.extend(_Pending(r, g, keys[g]) for g in range(r.num_samples))

    def sampling_of(self, request: Request) -> SamplingConfig:
        """The sampling of `request`: its own values, the engine's where it sets none.

        Raises:
            ValueError: a value out of range (see `SamplingConfig`).
        """
        d = self.sampling
        return SamplingConfig(
            temperature=d.temperature if request.temperature is None else request.temperature,
            top_k=d.top_k if request.top_k is None else max(int(request.top_k), 0),
            top_p=d.top_p if request.top_p is None else min(float(request.top_p), 1.0),
        )

    @property
    def queued(self) -> int:
        """Samples waiting for a slot."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Slots holding a sample."""
        return sum(s is not None for s in self._slots)

    def idle(self) -> bool:
        """True when nothing is queued or in flight."""
        return not self._queue and self.in_flight == 0

    # ---- weights ---------------------------------------------------------------------------
    def update_weights(self, params: nnx.State, version: int) -> None:
        """Use ``params`` from the next safe point on (no copy when already on our devices).

        Thread-safe; when several arrive between two safe points, the last one wins. With
        `BatcherConfig.packed_weights` in effect the projections are packed here, in the
        caller's thread, while the replica goes on decoding with the old version.
        """
        if self._packs:
            params = with_packed(self._plain_graphdef, params)[1]
        with self._weights_lock:
            self._pending_weights = (params, version)

    def _apply_weights(self) -> None:
        with self._weights_lock:
            pending, self._pending_weights = self._pending_weights, None
        if pending is None:
            return
        params, version = pending
        if version != self.version:  # a cache made by other weights is not this version's
            self._memory = [None] * self.cfg.num_slots
        self.params, self.version = params, version
        self._prefills.clear()
        self._prefix_kv.clear()  # computed by the old weights
        running = [i for i, s in enumerate(self._slots) if s is not None]
        if running:
            gen_len = np.asarray(self.state.gen_len)
            for i in running:
                slot = self._slots[i]
                assert slot is not None
                slot.spans.append((version, int(gen_len[i])))

    # ---- one scheduling round --------------------------------------------------------------
    def step(self) -> list[SampleResult]:
        """Safe point, fill free slots, decode until a slot finishes, collect finished samples."""
        self._apply_weights()
        self._fill()
        if self.in_flight == 0:
            return []
        matching = [i for i, s in enumerate(self._slots) if s is not None and s.matcher]
        n = self.cfg.steps_per_call
        if matching:
            n = min(n, self.cfg.stop_string_steps)
        kv_len, rows = self.kv_len(), self.row_bound()
        self.state, steps = self._loop(
            self.params, self.state, jnp.int32(n), kv_len=kv_len, rows=rows
        )
        self.decode_steps += int(steps)
        if matching:
            self._match_stop_strings(matching)
        return self._collect()

    def _matcher(self, request: Request) -> StopStringMatcher | None:
        if not request.stop_strings:
            return None
        assert self.decode is not None  # submit checked
        return StopStringMatcher(request.stop_strings, self.decode)

    def _match_stop_strings(self, slots: list[int]) -> None:
        """Push the new tokens of `slots` (those with stop strings) to their matchers and end
        each slot whose text now holds a stop: finished, reason "stop", its length cut to the
        token that completes the stop (tokens sampled past it in this call are dropped)."""
        rows = jnp.asarray(slots, jnp.int32)
        gen_len, tokens = jax.device_get((self.state.gen_len[rows], self.state.out_tokens[rows]))
        ends: list[tuple[int, int]] = []
        for j, i in enumerate(slots):
            slot = self._slots[i]
            assert slot is not None and slot.matcher is not None
            seen = len(slot.matcher.ids)
            k = slot.matcher.push(tokens[j, seen : int(gen_len[j])].tolist())
            if k is not None:
                ends.append((i, k))
        if ends:
            idx = jnp.asarray([i for i, _ in ends], jnp.int32)
            lengths = jnp.asarray([k for _, k in ends], jnp.int32)
            self.state = end_at_stop_string(self.state, idx, lengths)

    def kv_len(self) -> int | None:
        """The attention bound of the next decode call (see ``BatcherConfig.kv_bucket``), or
        None for all ``max_len`` slots. Reads the slots' positions ([B] int32) to the host."""
        bucket, cap = self.cfg.kv_bucket, self.cfg.max_len
        live = [i for i, s in enumerate(self._slots) if s is not None]
        if bucket <= 0 or not live:
            return None
        need = int(np.asarray(self.state.pos)[live].max()) + self.cfg.steps_per_call
        bound = doubling_bound(need, bucket, cap)
        return None if bound >= cap else bound

    def row_bound(self) -> int | None:
        """The rows of the next decode call (see ``BatcherConfig.row_bucket``): the smallest
        ``row_bucket * 2**k`` above every occupied slot, or None for all ``num_slots``."""
        bucket, cap = self.cfg.row_bucket, self.cfg.num_slots
        occupied = [i for i, s in enumerate(self._slots) if s is not None]
        if bucket <= 0 or not occupied or self.mesh is not None:
            return None
        bound = doubling_bound(occupied[-1] + 1, bucket, cap)
        return None if bound >= cap else bound

    def run_until_idle(self) -> list[SampleResult]:
        """Step until every queued and in-flight sample is done; returns them all."""
        out: list[SampleResult] = []
        while not self.idle():
            out.extend(self.step())
        return out

    def _fill(self) -> None:
        free = [i for i, s in enumerate(self._slots) if s is None]
        take = [self._queue.popleft() for _ in range(min(len(free), len(self._queue)))]
        if not take:
            return
        continued: list[tuple[int, _Pending, int]] = []
        for p in take:
            found = self._remembered(p, free)
            if found is not None:
                free.remove(found[0])
                continued.append((found[0], p, found[1]))
        if continued:
            self._extend(continued)
            done = {id(p) for _, p, _ in continued}
            take = [p for p in take if id(p) not in done]
            if not take:
                return
        free.sort(key=self._fresh_slot_order(free, len(take)))
        for i in free[: len(take)]:
            self._memory[i] = None
        self._prefill_for(take)
        groups: dict[int, list[tuple[int, _Pending]]] = {}
        for slot, p in zip(free, take, strict=False):
            batch, row = self._prefills[id(p.request)]
            groups.setdefault(id(batch), []).append((slot, p))
            routes = None
            if batch.routes is not None:  # [P_rows, T, L, k] -> this prompt's [P, L, k]
                routes = np.asarray(jax.device_get(batch.routes[row, : len(p.request.prompt)]))
            self._slots[slot] = _Slot(
                p.request, p.index, [(self.version, 0)], routes, self._matcher(p.request)
            )
        for members in groups.values():  # one insertion per prefill batch
            batch = self._prefills[id(members[0][1].request)][0]
            self._insert_rows(
                batch, [(slot, self._prefills[id(p.request)][1], p) for slot, p in members]
            )
        for p in take:  # a prompt's prefill is dropped once its last sample is in a slot
            if p.index == p.request.num_samples - 1:  # samples queue in index order
                self._prefills.pop(id(p.request), None)

    def _fresh_slot_order(self, free: list[int], need: int):  # noqa: ANN202 - a sort key
        """The order fresh samples take the free slots in: those below the smallest row bound
        R (``row_bucket * 2**k``) whose free slots suffice for `need` samples, so the decode
        rows stay few (`row_bound`); within and beyond R, the slots that remember nothing
        first, then the least recently used of those that remember a sample (kept for an
        episode's next turn), lowest index last."""
        bound, cap = self.cfg.row_bucket, self.cfg.num_slots
        if bound <= 0 or self.mesh is not None:
            bound = cap
        while bound < cap and sum(i < bound for i in free) < need:
            bound *= 2

        def key(i: int) -> tuple[bool, bool, int, int]:
            held = self._memory[i] is not None
            return (i >= bound, held, self._used[i] if held else 0, i)

        return key

    def _remembered(self, p: _Pending, free: list[int]) -> tuple[int, int] | None:
        """The free slot whose memory shares the longest prefix with `p`'s prompt, and that
        prefix's length (at least 1; at most the prompt's length - 1, so one token is left to
        prefill), for a one-sample request that `continues`; None otherwise."""
        r = p.request
        if not r.continues or r.num_samples != 1 or self.mesh is not None:
            return None
        prompt = np.asarray(r.prompt, np.int32)
        best: tuple[int, int] | None = None
        for i in free:
            held = self._memory[i]
            if held is None:
                continue
            n = common_prefix(prompt[: len(prompt) - 1], held[: len(held) - 1])
            if n >= 1 and (best is None or n > best[1]):
                best = (i, n)
        return best

    def _extend(self, continued: list[tuple[int, _Pending, int]]) -> None:
        """Prefill each continuation's new tokens into its slot (`extend.Extender`) and start
        the sample there, in chunks of ``prefill_batch``."""
        size = self.cfg.prefill_batch
        for k in range(0, len(continued), size):
            chunk = continued[k : k + size]
            batch = self.extender(
                self.params, self.state, [slot for slot, _, _ in chunk],
                [p.request.prompt[n:] for _, p, n in chunk], [n for _, _, n in chunk],
            )  # fmt: skip
            for slot, p, n in chunk:
                self._slots[slot] = _Slot(
                    p.request, p.index, [(self.version, 0)], None, self._matcher(p.request)
                )
                self._memory[slot] = None
                self.continued += 1
                self.reused_tokens += n
            self._insert_rows(batch, [(slot, j, p) for j, (slot, p, _) in enumerate(chunk)])

    def _insert_rows(self, batch: PrefillBatch, members: list[tuple[int, int, _Pending]]) -> None:
        """Start each (slot, row of `batch`, sample) of `members`: its first token sampled from
        the row's logits with the sample's key and sampling, the row's cache written into the
        slot (one compiled insertion per power of two n >= len(members), at most B rows;
        padding rows go to slot B, dropped). Padding to B rows instead gathered B rows of
        the prefill's cache each time: 145 ms per insertion of 8 GSM8K prompts into 128
        slots at SmolLM2 bf16, against 12 ms."""
        b = self.cfg.num_slots
        n = min(next_pow2(len(members)), b)
        slots = np.full(n, b, np.int32)
        rows = np.zeros(n, np.int32)
        keys = np.zeros((n, 2), np.uint32)
        max_new = np.ones(n, np.int32)
        temperature = np.ones(n, np.float32)
        top_k = np.zeros(n, np.int32)
        top_p = np.ones(n, np.float32)
        for j, (slot, row, p) in enumerate(members):
            slots[j], rows[j] = slot, row
            keys[j], max_new[j] = p.key_data, p.request.max_new_tokens
            s = self.sampling_of(p.request)
            temperature[j], top_k[j], top_p[j] = s.temperature, s.top_k, s.top_p
        row_sampling = RowSampling(jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p))
        self.state = self._insert(self.state, batch, slots, rows, keys, max_new, row_sampling)

    def _prefill_for(self, take: list[_Pending]) -> None:
        needed = list(dict.fromkeys(p.request for p in take if id(p.request) not in self._prefills))
        if not needed:
            return
        ahead = [q.request for q in self._queue if id(q.request) not in self._prefills]
        for r in ahead:
            if len(needed) >= self.cfg.prefill_batch:
                break
            if r not in needed:
                needed.append(r)
        # requests of one prompt (the first turns of a group's episodes) share one row
        sharing: dict[tuple[int, ...], list[Request]] = {}
        for r in needed:
            sharing.setdefault(tuple(r.prompt), []).append(r)
        prompts = list(sharing)
        size = self.cfg.prefill_batch
        if len(prompts) > size:  # chunks of like lengths pad to smaller T buckets
            prompts.sort(key=len)
        for start in range(0, len(prompts), size):
            chunk = prompts[start : start + size]
            batch = self._prefill_chunk(chunk)
            self.prefilled_rows += len(chunk)
            for row, prompt in enumerate(chunk):
                for r in sharing[prompt]:
                    self._prefills[id(r)] = (batch, row)

    def _prefill_chunk(self, chunk: list[tuple[int, ...]]) -> PrefillBatch:
        """One prefill call over ``chunk``'s prompts: behind their shared prefix
        (`BatcherConfig.shared_prefix_min`) where they have one, else each whole."""
        n0 = self._shared_length(chunk)
        suffixes = [c[n0:] for c in chunk]
        if not n0 or not self.prefiller.fits(n0, suffixes):
            return self.prefiller(self.params, chunk)
        key = chunk[0][:n0]
        prefix = self._prefix_kv.get(key)
        if prefix is None:
            prefix = self.prefiller.shared_prefix(self.params, key)
            self.prefixes_prefilled += 1
            self._prefix_kv[key] = prefix
            while len(self._prefix_kv) > PREFIX_CACHE_ENTRIES:
                self._prefix_kv.popitem(last=False)
        self._prefix_kv.move_to_end(key)
        self.shared_prefix_tokens += n0 * len(chunk)
        return self.prefiller(self.params, suffixes, prefix)

    def _shared_length(self, chunk: list[tuple[int, ...]]) -> int:
        """n0: the longest prefix, a multiple of 8 of at least ``shared_prefix_min`` tokens,
        that every prompt of ``chunk`` has with a token left after it; for a lone prompt
        only a prefix already cached (computing one for a single row saves nothing); 0:
        none."""
        if not self._shares_prefixes:
            return 0
        first = np.asarray(chunk[0], np.int32)
        n = min(map(len, chunk)) - 1
        for prompt in chunk[1:]:
            n = min(n, common_prefix(first, np.asarray(prompt, np.int32)))
        n -= n % 8
        if len(chunk) == 1:
            n = max((len(k) for k in self._prefix_kv if len(k) <= n and chunk[0][: len(k)] == k),
                    default=0)  # fmt: skip
        return n if n >= self.cfg.shared_prefix_min else 0

    def _collect(self) -> list[SampleResult]:
        self.state, fetched = _collect_and_release(self.state)
        *small, routes_all = fetched
        mask, tokens, logprobs, forced, lengths, reasons = jax.device_get(tuple(small))
        done = np.flatnonzero(mask)
        routes = None  # [len(done), C, L, k]: only the finished rows leave the device
        if routes_all.shape[1] and len(done):
            routes = np.asarray(jax.device_get(routes_all[jnp.asarray(done)]))
        out = []
        for j, i in enumerate(done):
            slot = self._slots[i]
            assert slot is not None
            self._slots[i] = None
            n = int(lengths[i])
            self._clock += 1
            self._used[i] = self._clock
            whole = slot.spans == [(self.version, 0)]  # one version made this cache row
            self._memory[i] = (
                np.concatenate([np.asarray(slot.request.prompt, np.int32), tokens[i, :n]])
                if whole and self.mesh is None
                else None
            )
            sample_routes = None
            if slot.prompt_routes is not None and routes is not None and n >= 1:
                # the prefill's rows, then the decode steps'
                sample_routes = np.concatenate([slot.prompt_routes, routes[j, : n - 1]])
            bounds = [s for _, s in slot.spans[1:]] + [n]
            spans = [(v, s, e) for (v, s), e in zip(slot.spans, bounds, strict=True) if e > s]
            out.append(
                SampleResult(
                    prompt_id=slot.request.prompt_id,
                    sample_index=slot.index,
                    tokens=tokens[i, :n].astype(np.int32),
                    logprobs=logprobs[i, :n].astype(np.float32),
                    forced_positions=tuple(int(j) for j in np.flatnonzero(forced[i, :n])),
                    finish_reason=FINISH_REASONS[int(reasons[i])],
                    weight_versions=spans,
                    replica=self.replica,
                    routes=None if sample_routes is None else sample_routes.astype(np.int32),
                )
            )
        return out


@partial(jax.jit, donate_argnums=(0,))
def end_at_stop_string(state: SlotState, rows: jax.Array, lengths: jax.Array) -> SlotState:
    """Finish ``rows`` (``[R]`` int32 slot indices) with reason "stop" (`STOP_EOS`, the code
    reported as "stop"), each with ``lengths`` (``[R]`` int32) completion tokens kept."""
    return dataclasses.replace(
        state,
        finished=state.finished.at[rows].set(True),
        reason=state.reason.at[rows].set(STOP_EOS),
        gen_len=state.gen_len.at[rows].set(lengths),
    )


@partial(jax.jit, donate_argnums=(0,))
def _collect_and_release(state: SlotState) -> tuple[SlotState, tuple[jax.Array, ...]]:
    """Copy out the finished slots' rows and mark those slots free, in one compiled call.

    Returns the state and ``(done [B] bool, out_tokens [B, C], out_logprobs [B, C],
    out_forced [B, C], gen_len [B], reason [B], out_routes [B, C, L, k])``; only rows with
    ``done`` are meaningful.
    """
    done = state.active & state.finished
    fetched = (
        done,
        state.out_tokens,
        state.out_logprobs,
        state.out_forced,
        state.gen_len,
        state.reason,
        state.out_routes,
    )
    fetched = jax.tree.map(jnp.copy, fetched)  # outputs must not alias the donated state
    released = dataclasses.replace(
        state, active=state.active & ~done, finished=state.finished & ~done
    )
    return released, fetched
