"""Seconds, GB/s and peak extra memory of a weight push from JAX params into a running vLLM
engine, against a plain memory copy of the same bytes in the same run.

The real path, as `tests/integration/test_engine_end_to_end.py` wires it: a gateway process
(`python -m gateway serve`), one engine process (`python -m rollout_engine --backend vllm`,
bf16 by default) started on the model's HF folder, and this process as the trainer holding the
model's fp32 JAX params and pushing them with `trainer.publish.WeightPublisher` over gloo
(cast to the wire dtype in JAX, mapping layout, buckets, broadcast, vLLM's layerwise reload,
prefix-cache reset). The engine serves a prompt before the pushes, and one at the last
version after them (its rollout must be stamped with that version).

Models: `smollm2` (the real SmolLM2-135M-Instruct, `models.checkpoints.smollm2`; 9 heads, 3
KV heads: TP 1 or 3 only), `0.5b` (a random llama of 0.47B params written by
`make_tiny_checkpoint`: D 1024, F 4096, 24 layers, 16 heads, 4 KV heads, V 49,152, untied) and
`0.1b` (a random llama of 0.096B params: D 512, F 2048, 16 layers, 8 heads, 2 KV heads, V 32,768,
untied; TP 2 fits the 2 cores). The engine runs at TP `--tp` (`--vllm-tensor-parallel-size`; on
CPU each TP worker is bound to its own core, `VLLM_CPU_OMP_THREADS_BIND` "0|1" for TP 2). For
each `--tp-shards` value (`GlooTransportConfig.tp_shards`: "on" sends each TP rank only its own
shard of each tensor-parallel tensor, "off" every tensor whole to every rank; at TP 1 both are
the same, so only one runs) and each bucket size, a fresh publisher (a new gloo group) makes one
warm-up push (group formation, first casts) and `--repeats` timed pushes. `rank_bytes` is what
each engine TP rank received per push (payload bytes, from the manifest: the whole tensor, or
its `Manifest.region` for a sharded one), `push_gb_per_s` is the model's bytes over the push.
Reference: right after each timed push, the median GB/s of 3 copies of the same number of bytes
(the model's bytes in the wire dtype) between two preallocated torch buffers; `ratio_vs_memcpy`
is the median over the pushes of push GB/s / that memcpy GB/s (measured back to back, as the 2
shared cores' load changes). After each bucket size's pushes, `common.gloo_reference` measures,
against a child process on loopback and with the same bytes and buckets: `raw_gloo_gb_per_s`,
a bare torch gloo broadcast of preallocated buffers (the wire alone), and
`transport_gb_per_s`, the project's `GlooSender` (packing from the same fp32 params, the
pipelined broadcast, the commit) into a receiver that drops the buckets. `push_over_raw_gloo`
is push GB/s over the raw broadcast (what vLLM's load adds is in it),
`transport_over_raw_gloo` the data plane's own share, and `pack_gb_per_s` /
`pack_over_raw_gloo` the packing alone (mapping layout, cast to the wire dtype, copy into the
sender's reused buffers; nothing sent): on a host where packing is not much faster than the
wire, and both run on the same cores, it bounds what the push can reach. That bound is
measured too: `raw_gloo_cores` is how many cores the raw broadcast alone keeps busy (CPU
seconds of both ends over its wall seconds), `pack_cpu_s_per_gb` the packing's CPU time, and
`host_ceiling_over_raw_gloo` the best `push_over_raw_gloo` that `host_cores` cores allow when
the wire's and the packing's CPU time must both fit on them (the engine's load not counted).
`push_over_host_ceiling` is `push_over_raw_gloo` over min(1, that ceiling). The data plane's
own cost, without the cast: `gloo_reference` again with the same tensors already cast to the
wire dtype and made contiguous (`_wire_tensors`, not timed), its raw broadcast measured in that
call: `transport_wire_over_raw_gloo`. The references send whole tensors to one receiver,
whatever `--tp` is.

Where the push's seconds go (gloo; `push_phases` says how each part is timed, on the
trainer's side and the engine's, whose worker logs its phases with each loaded version):
`pack_s`, `wire_s`, `receive_copy_s`, `engine_load_s` and `commit_vote_s`, each the median
over the timed pushes; they may add up to more than `push_s` by what the bucket pipeline
overlaps. `vllm_load_s` is the floor any push pays: after the last push the engine, still
paused, loads the checkpoint's same tensors from memory through vLLM's own update session
(start, `load_weights`, finish), alone, 3 times; the median (`rollout_engine.vllm.backend.
LOAD_FLOOR_ENV`).

Data planes (`--data-plane`, one engine each, the gateway started with that transport): gloo,
and shm (`transport.shm`: the trainer packs each version into a shared-memory segment under
/dev/shm that the engine maps; whole tensors to every TP rank). `send_over_memcpy` is the
median over the pushes of the data-plane send's GB/s (for shm: packing into the segment, cast
included, and the commit; the engine's load comes after, in `loaded`) over the memcpy GB/s
measured right after it. After shm's pushes, `shm_reference.shm_reference` times shm alone
(wire-dtype tensors written once into a reused segment, mapped and viewed by a receiver that
loads nothing) against a memcpy of the same bytes: `shm_over_memcpy`. The last line's
`shm_push_s`, `shm_push_gb_per_s`, `shm_over_memcpy` and `shm_push_send_over_memcpy` (the shm
push's own send ratio, the cast from the fp32 params included) are shm's figures at the first
bucket size, beside gloo's and `vllm_load_s`.

Memory: before each push the peak-RSS counter (VmHWM) of this process and of every process of
the engine's tree (the CLI process, vLLM's EngineCore and, on CPU, its Workers, which hold the
model and the receivers) is reset (`/proc/PID/clear_refs` = 5, Linux >= 4.0); after it, extra =
VmHWM - VmRSS before. Engine extra is reported per process (max over the timed pushes) and
summed over the tree (an upper bound: the peaks need not coincide); `first_push_*` is the same
for the warm-up push. Memory that a push frees stays in the process's allocator (glibc in this
process, tcmalloc in vLLM's workers) and is reused by the next push without raising RSS, so a
later push, or a later bucket size on the same engine, shows less than it uses: with
`--fresh-engine` each (tp_shards, bucket size) gets a new engine, and its `first_push_*` figure
is what that bucket size costs an engine that never pushed before.

Several trainer processes (`--trainer-processes 1,2 [--steps 4]`): instead of the pushes
above, the main job's own pushes of SmolLM2 with the trainer as each count of processes over
the same devices (fan-in), against the memcpy and raw gloo broadcast of the same bytes
(`benchmarks/trainer_processes.py` says how); with `--data-plane gloo,jax_transfer` over
each of them into the JAX engine.

Usage: python benchmarks/weight_sync.py [--models smollm2,0.5b,0.1b] [--bucket-mb 256,64,16]
    [--repeats 2] [--dtype bfloat16] [--tp 1] [--tp-shards on,off] [--fresh-engine]
    [--data-plane gloo,shm] [--trainer-processes 1,2 --steps 4 [--data-plane gloo,jax_transfer]]
    [--lora RANK [--engines jax,vllm] [--models smollm2|tiny|0.5b|0.1b]] (adapter-only against
    full pushes: benchmarks/lora_sync.py)
Prints one line per push, then one JSON object on the last line: its top-level figures are the
first model at the first data plane, the first `--tp-shards` value and the first bucket size
(256 MiB, the transport's default bucket), `models` holds every model, data plane, `--tp-shards`
value and bucket size (push seconds
and GB/s are medians of the timed pushes, peak extra MB the maximum over them).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import psutil
from common import CPU_ENV, gloo_reference, memcpy_gb_per_s
from push_phases import BREAKDOWN_KEYS, engine_phases, push_breakdown
from shm_reference import shm_reference
from stack import engine_stack

from gateway import messages as m
from gateway.client import GatewayClient
from mappings.apply import params_to_engine
from mappings.registry import get_family
from models.checkpoints.hf_io import load_hf_checkpoint
from models.checkpoints.smollm2 import ensure_smollm2
from models.checkpoints.tiny import make_tiny_checkpoint
from models.params import flat_params
from rollout_engine.vllm.backend import LOAD_FLOOR_ENV
from trainer.publish import WeightPublisher
from trainer.publish.host_views import HostView
from transport.config import GlooTransportConfig, ShmTransportConfig
from transport.manifest import DTYPE_BYTES, Manifest

#: make_tiny_checkpoint overrides of the ~0.5B random llama (0.47B params).
LLAMA_05B = dict(
    vocab_size=49152,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    tie_word_embeddings=False,
)
#: make_tiny_checkpoint overrides of the ~0.1B random llama (0.096B params) that splits over TP 2.
LLAMA_01B = dict(
    vocab_size=32768,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=16,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=False,
)
RANDOM_MODELS: dict[str, dict[str, Any]] = {"0.5b": LLAMA_05B, "0.1b": LLAMA_01B}
#: Prompt token ids, below every model's vocabulary (32,768).
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173]


def _status_kb(pid: int, field: str) -> int:
    """A `/proc/PID/status` field in kB (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


class PeakRss:
    """Peak extra resident memory of some processes over a window (see the module docstring).

    Args:
        pids: label -> pid.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before: dict[str, int] = {}

    def __enter__(self) -> PeakRss:
        for label, pid in self.pids.items():
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.before[label] = _status_kb(pid, "VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.extra_mb = {
            label: max(_status_kb(pid, "VmHWM") - self.before[label], 0) / 1024
            for label, pid in self.pids.items()
        }


def serve_one(trainer: GatewayClient, sample_id: str, version: int) -> None:
    """One greedy prompt at `version` or later; raises unless its rollout is stamped `version`."""
    sampling = m.SamplingParams(temperature=0.0, max_new_tokens=8)
    trainer.submit_prompts(
        [m.Prompt(sample_id, np.asarray(PROMPT, np.int32), 1, sampling, min_version=version)]
    )
    (group,) = trainer.fetch_rollouts(1, timeout_s=300, min_groups=1)
    (c,) = group.completions
    if (c.version_start, c.version_end, len(c.token_ids)) != (version, version, 8):
        raise RuntimeError(f"served {c} at version {version}: expected 8 tokens at {version}")


def rank_bytes(manifest: Manifest, tp: int) -> list[int]:
    """Payload bytes each of an engine's `tp` ranks receives for one version of `manifest`
    (alignment padding excluded): every tensor whole, or, for a sharded manifest, each
    tensor's `Manifest.region` for that rank (replicated tensors whole)."""
    if not manifest.sharded:
        return [manifest.total_bytes] * tp
    out = []
    for r in range(tp):
        n = 0
        for i, t in enumerate(manifest.tensors):
            extents = [s.stop - s.start for s in manifest.region(i, r)]
            n += int(np.prod(extents)) * DTYPE_BYTES[t.dtype]
        out.append(n)
    return out


def bench_model(label: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """Every `--tp-shards` value and bucket size's pushes of `model_dir` into an engine at TP
    `args.tp`: one engine for all of them, or with `--fresh-engine` a new one for each (see
    the docstring)."""
    cfg, decoder = load_hf_checkpoint(model_dir, dtype="float32")
    params = flat_params(decoder)
    num_params = sum(int(np.prod(v.shape)) for v in params.values())
    shard_modes = args.tp_shards if args.tp > 1 else args.tp_shards[:1]
    per_plane = {
        plane: [(plane, s, mb) for s in (shard_modes if plane == "gloo" else [False])
                for mb in args.bucket_mb]
        for plane in args.data_plane
    }  # fmt: skip
    rows: list = []
    first: dict = {}
    refs: dict = {}
    for combos in per_plane.values():
        for group in [[c] for c in combos] if args.fresh_engine else [combos]:
            _bench_engine(label, model_dir, cfg, params, args, group, rows, first, refs)
    per_bucket = [
        _summary(combo, args.tp, [r for r in rows if r[0] == combo], first[combo], refs.get(combo))
        for combos in per_plane.values()
        for combo in combos
    ]
    return {"params": num_params, "bytes": rows[0][1].num_bytes, "per_bucket": per_bucket}


def _bench_engine(
    label: str,
    model_dir: Path,
    cfg: Any,
    params: dict,
    args: argparse.Namespace,
    combos: list[tuple[str, bool, int]],
    rows: list,
    first: dict,
    refs: dict,
) -> None:
    """Start one engine and run each (data plane, tp_shards, bucket MiB) of `combos` (one data
    plane) on it: a warm-up push (its peak extra MB by process go to `first[combo]`) and
    `args.repeats` timed pushes (rows of (combo, PushStats, peak extra MB by process, memcpy
    GB/s, payload bytes per TP rank, the push's breakdown (`push_phases.push_breakdown`;
    empty unless over gloo), vLLM's own load seconds) appended to `rows`), then, over gloo,
    the gloo references of that bucket size (`common.gloo_reference`, whole tensors to one
    receiver) in `refs[combo]`. Last, one more push, untimed, after which the engine
    measures vLLM's own load of the checkpoint's tensors from memory (`LOAD_FLOOR_ENV`);
    the engine's phases of every push come from its log."""
    num_params = sum(int(np.prod(v.shape)) for v in params.values())
    version = 0
    floor_version = len(combos) * (args.repeats + 1) + 1  # one more push, untimed, at the end
    os.environ[LOAD_FLOOR_ENV] = str(floor_version)  # the engine measures vLLM's own load then
    mine: list = []  # this engine's rows (their engine phases are added at the end)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        plane = combos[0][0]
        stack = engine_stack(
            Path(tmp), model_dir, cfg.family, args.dtype, 256, args.tp, plane,
            engine_args=("--log-level", "INFO"),  # its "loaded version" lines carry phases
        )  # fmt: skip
        with stack as (trainer, engine):
            print(
                f"{label}: {num_params / 1e6:.1f} M params; engine (TP {args.tp}) up in "
                f"{time.perf_counter() - t0:.0f} s"
            )
            serve_one(trainer, f"{label}-before", 0)
            root = psutil.Process(engine.pid)
            tree = [root, *root.children(recursive=True)]
            pids = {"trainer": os.getpid()}
            pids |= {f"engine:{p.pid}:{_name(p)}": p.pid for p in tree}
            for combo in combos:
                _, shards, mb = combo
                transport: GlooTransportConfig | ShmTransportConfig
                if plane == "shm":
                    shm_root = f"/dev/shm/jaxrl-bench-{os.getpid()}"
                    transport = ShmTransportConfig(root=shm_root, bucket_bytes=mb << 20)
                else:
                    transport = GlooTransportConfig(
                        port=0, timeout_s=300, bucket_bytes=mb << 20, tp_shards=shards
                    )
                publisher = WeightPublisher(trainer, transport, cfg.family, cfg, args.dtype)
                try:
                    for r in range(args.repeats + 1):
                        version += 1
                        with PeakRss(pids) as peak:
                            stats = publisher.push(params, version)
                        per_rank = rank_bytes(publisher.manifest(version, stats.tp_size), args.tp)
                        tag = "warm-up" if r == 0 else "timed"
                        print(
                            f"  {plane} TP {args.tp} shards {'on' if shards else 'off'} bucket "
                            f"{mb} MB "
                            f"v{version} ({tag}): {stats.seconds:.3f} s (ready "
                            f"{stats.ready_s:.3f}, send {stats.send_s:.3f}, loaded "
                            f"{stats.loaded_s:.3f}), {stats.gb_per_s:.3f} GB/s, "
                            f"{stats.num_buckets} buckets, rank MB "
                            f"{[round(b / 1e6, 1) for b in per_rank]}; peak extra MB "
                            f"{ {k: round(v) for k, v in peak.extra_mb.items()} }"
                        )
                        if r == 0:
                            first[combo] = peak.extra_mb
                        else:
                            memcpy = memcpy_gb_per_s(stats.num_bytes)
                            mine.append((combo, stats, peak.extra_mb, memcpy, per_rank))
                    ready = _wire_tensors(cfg, params, args.dtype)
                    if plane == "shm":
                        refs[combo] = shm_reference(
                            functools.partial(publisher.manifest, tp_size=1),
                            functools.partial(list, ready),
                        )
                        print(
                            f"  bucket {mb} MB, shm alone (tensors in the wire dtype, no engine): "
                            f"{refs[combo]['shm_gb_per_s']:.3f} GB/s, a memcpy "
                            f"{refs[combo]['shm_memcpy_gb_per_s']:.3f} GB/s"
                        )
                    if plane != "gloo":
                        continue
                    manifests = [publisher.manifest(v, 1) for v in range(args.repeats + 1)]
                    ref = gloo_reference(
                        manifests, lambda: _engine_tensors(cfg, params, args.dtype)
                    )
                    wire = gloo_reference(manifests, functools.partial(list, ready))
                    ref["transport_wire_over_raw_gloo"] = (
                        wire["transport_gb_per_s"] / wire["raw_gloo_gb_per_s"]
                    )
                    print(
                        f"  bucket {mb} MB, tensors already in the wire dtype: the transport "
                        f"{wire['transport_gb_per_s']:.3f} GB/s, raw gloo "
                        f"{wire['raw_gloo_gb_per_s']:.3f} GB/s"
                    )
                    print(
                        f"  bucket {mb} MB, one receiver without an engine: raw gloo "
                        f"{ref['raw_gloo_gb_per_s']:.3f} GB/s, the transport "
                        f"{ref['transport_gb_per_s']:.3f} GB/s, packing alone "
                        f"{ref['pack_gb_per_s']:.3f} GB/s; raw gloo keeps "
                        f"{ref['raw_gloo_cores']:.2f} of {ref['host_cores']} cores busy, so "
                        f"no push here beats {ref['host_ceiling_over_raw_gloo']:.2f} of it"
                    )
                    refs[combo] = ref
                finally:
                    publisher.close()
            version += 1  # vLLM's own load of the same tensors from memory, alone
            publisher = WeightPublisher(trainer, transport, cfg.family, cfg, args.dtype)
            try:
                publisher.push(params, version)
            finally:
                publisher.close()
            serve_one(trainer, f"{label}-after", version)
        phases = engine_phases((Path(tmp) / "engine.log").read_text())
    os.environ.pop(LOAD_FLOOR_ENV)
    floor = phases[floor_version]["vllm_load_floor_s"]
    print(f"  vLLM's own load of the same tensors from memory, alone: {floor:.3f} s")
    for row in mine:
        engine_side = phases[row[1].version]
        parts = push_breakdown(row[1], engine_side) if plane == "gloo" else {}
        rows.append((*row, parts, floor))
        if parts:
            shown = {k: round(v, 3) for k, v in parts.items()}
            print(f"  v{row[1].version} breakdown (s): {shown} of {row[1].seconds:.3f}")


def _wire_tensors(cfg: Any, params: dict, dtype: str) -> list[tuple[str, Any]]:
    """`_engine_tensors` cast to `dtype` and made contiguous once (not timed): what the data
    plane alone moves, with nothing left to cast or lay out."""
    import torch

    from transport.base import as_torch

    wire = getattr(torch, dtype)
    return [(n, as_torch(a).to(wire).contiguous()) for n, a in _engine_tensors(cfg, params, dtype)]


def _engine_tensors(cfg: Any, params: dict, dtype: str):
    """(HF name, array) of `params` in manifest order, as `WeightPublisher` streams them: the
    mapping's layout as strided views, cast to the wire `dtype` while packed."""
    view = HostView(params, jnp.dtype(dtype))
    return params_to_engine(get_family(cfg.family), cfg, view, contiguous=False)


def _name(p: psutil.Process) -> str:
    cmd = " ".join(p.cmdline())
    return "cli" if "rollout_engine" in cmd else p.name()


def _summary(
    combo: tuple[str, bool, int],
    tp: int,
    rows: list,
    first: dict[str, float],
    ref: dict[str, float] | None,
) -> dict:
    """One (data plane, tp_shards, bucket MiB)'s figures from its timed pushes (rows of
    (combo, PushStats, peak extra MB by process, memcpy GB/s measured right after the push,
    payload bytes per TP rank, breakdown by part, vLLM's own load seconds)), its warm-up
    push's peak extra MB by process and, over gloo, its gloo references
    (`common.gloo_reference`)."""
    plane, shards, mb = combo
    secs = statistics.median(s.seconds for _, s, *_ in rows)
    send = statistics.median(s.send_s for _, s, *_ in rows)
    num_bytes = rows[0][1].num_bytes
    ratio = statistics.median(s.gb_per_s / c for _, s, _, c, *_ in rows)
    extra = {k: max(e[k] for _, _, e, *_ in rows) for k in rows[0][2]}
    engine = {k: v for k, v in extra.items() if k.startswith("engine")}
    out = {
        "data_plane": plane,
        "tp": tp,
        "tp_shards": shards,
        "sharded": rows[0][1].tp_size > 1,
        "bucket_mb": mb,
        "buckets": rows[0][1].num_buckets,
        "rank_bytes": rows[0][4],
        "push_s": round(secs, 3),
        "push_gb_per_s": round(num_bytes / secs / 1e9, 3),
        "send_gb_per_s": round(num_bytes / send / 1e9, 3),
        "memcpy_gb_per_s": round(statistics.median(c for _, _, _, c, *_ in rows), 3),
        "ratio_vs_memcpy": round(ratio, 4),
        "send_over_memcpy": round(
            statistics.median(s.send_gb_per_s / c for _, s, _, c, *_ in rows), 4
        ),
        "trainer_peak_extra_mb": round(extra["trainer"], 1),
        "engine_peak_extra_mb": {k: round(v, 1) for k, v in engine.items()},
        "engine_tree_peak_extra_mb": round(sum(engine.values()), 1),
        "first_push_trainer_extra_mb": round(first["trainer"], 1),
        "first_push_engine_tree_extra_mb": round(
            sum(v for k, v in first.items() if k.startswith("engine")), 1
        ),
        "vllm_load_s": round(rows[0][6], 3),
    }
    if rows[0][5]:  # the breakdown of a gloo push (`push_phases`): medians over the pushes
        for key in BREAKDOWN_KEYS:
            out[key] = round(statistics.median(r[5][key] for r in rows), 4)
    if ref is not None and "shm_over_memcpy" in ref:
        out["shm_gb_per_s"] = round(ref["shm_gb_per_s"], 3)
        out["shm_memcpy_gb_per_s"] = round(ref["shm_memcpy_gb_per_s"], 3)
        out["shm_over_memcpy"] = round(ref["shm_over_memcpy"], 4)
    elif ref is not None:
        raw = ref["raw_gloo_gb_per_s"]
        out["raw_gloo_gb_per_s"] = round(raw, 3)
        out["push_over_raw_gloo"] = round(num_bytes / secs / 1e9 / raw, 4)
        out["transport_gb_per_s"] = round(ref["transport_gb_per_s"], 3)
        out["transport_over_raw_gloo"] = round(ref["transport_gb_per_s"] / raw, 4)
        out["pack_gb_per_s"] = round(ref["pack_gb_per_s"], 3)
        out["pack_over_raw_gloo"] = round(ref["pack_gb_per_s"] / raw, 4)
        for key in ("raw_gloo_cpu_s_per_gb", "raw_gloo_cores", "pack_cpu_s_per_gb"):
            out[key] = round(ref[key], 3)
        out["host_cores"] = ref["host_cores"]
        out["host_ceiling_over_raw_gloo"] = round(ref["host_ceiling_over_raw_gloo"], 4)
        out["push_over_host_ceiling"] = round(
            out["push_over_raw_gloo"] / min(1.0, ref["host_ceiling_over_raw_gloo"]), 4
        )
        out["transport_wire_over_raw_gloo"] = round(ref["transport_wire_over_raw_gloo"], 4)
    return out


def _trainer_processes(counts: list[int], steps: int, data_planes: tuple[str, ...]) -> dict:
    """`trainer_processes.bench_trainer_processes` with this script's references: the memcpy
    and the raw gloo broadcast (`common.gloo_reference`) of SmolLM2's bf16 engine tensors."""
    from trainer_processes import bench_trainer_processes

    path = ensure_smollm2()
    cfg, decoder = load_hf_checkpoint(path, dtype="float32")
    params = flat_params(decoder)

    def references(num_bytes: int) -> dict[str, float]:
        shapes = [(n, tuple(a.shape)) for n, a in _engine_tensors(cfg, params, "bfloat16")]
        manifests = [Manifest.of(v, shapes, "bfloat16", 256 << 20) for v in (1, 2, 3)]
        ref = gloo_reference(manifests, lambda: _engine_tensors(cfg, params, "bfloat16"))
        return {
            "memcpy_gb_per_s": memcpy_gb_per_s(num_bytes),
            "raw_gloo_gb_per_s": ref["raw_gloo_gb_per_s"],
        }

    env = {**os.environ, **CPU_ENV}
    with tempfile.TemporaryDirectory() as tmp:
        figures = bench_trainer_processes(counts, steps, Path(tmp), env, references, data_planes)
    for r in figures["runs"]:
        share = r["sent_fraction_by_process"]
        print(f"{r['data_plane']}, {r['engine']} engine, trainer processes "
              f"{r['trainer_processes']}: push {r['push_s']} s, {r['push_gb_per_s']} GB/s, "
              f"sent by process {share}")  # fmt: skip
    return {"model": "smollm2", "data_planes": list(data_planes), **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm2", help="comma-separated: smollm2, 0.5b, 0.1b")
    parser.add_argument("--bucket-mb", default="256,64,16", help="comma-separated bucket MiB")
    parser.add_argument("--repeats", type=int, default=2, help="timed pushes per bucket size")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--tp", type=int, default=1, help="engine tensor-parallel size")
    parser.add_argument(
        "--fresh-engine",
        action="store_true",
        help="a new engine for each --tp-shards value and bucket size (memory not hidden by "
        "what an earlier bucket size left in the allocators)",
    )
    parser.add_argument(
        "--tp-shards", default="on", help="comma-separated on/off: GlooTransportConfig.tp_shards"
    )
    parser.add_argument(
        "--data-plane", default="gloo,shm", help="comma-separated: gloo, shm (one engine each)"
    )
    parser.add_argument(
        "--trainer-processes",
        default="",
        help="comma-separated trainer process counts, e.g. 1,2: instead of the pushes above, "
        "the main job's pushes of SmolLM2 over each --data-plane (gloo, jax_transfer) with the "
        "trainer as that many processes (benchmarks/trainer_processes.py)",
    )
    parser.add_argument("--steps", type=int, default=4, help="job steps per --trainer-processes")
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        help="RANK > 0: instead of the pushes above, adapter-only pushes of this rank against "
        "full pushes of the merged model, into each --engines (benchmarks/lora_sync.py)",
    )
    parser.add_argument("--engines", default="jax,vllm", help="with --lora: comma-separated")
    args = parser.parse_args()
    if args.lora:
        from lora_sync import bench_lora

        engines = [x for x in args.engines.split(",") if x]
        name = args.models.split(",")[0]
        known = ("smollm2", "tiny", *RANDOM_MODELS)
        if args.lora < 0 or not engines or set(engines) - {"jax", "vllm"} or args.repeats < 1:
            parser.error("--lora takes a rank >= 1; --engines jax and/or vllm; --repeats >= 1")
        if name not in known:
            parser.error(f"with --lora, --models takes one of {list(known)} (got {name!r})")
        with tempfile.TemporaryDirectory() as tmp:
            if name == "smollm2":
                path = ensure_smollm2()
            elif name == "tiny":  # the tests' SmolLM2-shaped random model
                path = make_tiny_checkpoint(Path(tmp) / name, "smollm2")
            else:
                path = make_tiny_checkpoint(
                    Path(tmp) / name, "llama", dtype="bfloat16", **RANDOM_MODELS[name]
                )
            result = bench_lora(path, args.lora, engines, args.dtype, args.repeats)
        print(json.dumps({"model": name, "rank": args.lora, "dtype": args.dtype, **result}))
        return
    if args.trainer_processes:
        counts = [int(x) for x in args.trainer_processes.split(",") if x]
        if not counts or min(counts) < 1 or args.steps < 2:
            parser.error("--trainer-processes takes counts >= 1; --steps >= 2")
        planes = tuple(x for x in args.data_plane.split(",") if x)
        if args.data_plane == "gloo,shm":  # the default of the other mode
            planes = ("gloo",)
        if not planes or set(planes) - {"gloo", "jax_transfer"}:
            parser.error(f"with --trainer-processes, --data-plane takes gloo and/or "
                         f"jax_transfer (got {args.data_plane!r})")  # fmt: skip
        print(json.dumps(_trainer_processes(counts, args.steps, planes)))
        return
    args.data_plane = [x for x in args.data_plane.split(",") if x]
    if not args.data_plane or set(args.data_plane) - {"gloo", "shm"}:
        parser.error(f"--data-plane takes gloo and/or shm (got {args.data_plane!r})")
    args.bucket_mb = [int(x) for x in args.bucket_mb.split(",")]
    modes = [x for x in args.tp_shards.split(",") if x]
    if not modes or set(modes) - {"on", "off"}:
        parser.error(f"--tp-shards takes on and/or off (got {args.tp_shards!r})")
    args.tp_shards = [x == "on" for x in modes]
    models = [x for x in args.models.split(",") if x]
    unknown = set(models) - {"smollm2", *RANDOM_MODELS}
    if unknown or not models or args.repeats < 1 or args.tp < 1:
        parser.error(
            f"--models takes smollm2, 0.5b, 0.1b (got {models}); --repeats >= 1; --tp >= 1"
        )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            if name == "smollm2":
                path = ensure_smollm2()
            else:
                path = make_tiny_checkpoint(
                    Path(tmp) / f"llama{name}", "llama", dtype="bfloat16", **RANDOM_MODELS[name]
                )
            results[name] = bench_model(name, path, args)
    rows = results[models[0]]["per_bucket"]
    first = rows[0]
    summary = {"model": models[0], "dtype": args.dtype, **first}
    shm = [r for r in rows if r["data_plane"] == "shm" and r["bucket_mb"] == first["bucket_mb"]]
    if shm:  # the same bucket size through shared memory, beside the first data plane's
        summary["shm_push_s"] = shm[0]["push_s"]
        summary["shm_push_gb_per_s"] = shm[0]["push_gb_per_s"]
        summary["shm_over_memcpy"] = shm[0]["shm_over_memcpy"]
        summary["shm_push_send_over_memcpy"] = shm[0]["send_over_memcpy"]
        summary["shm_push_over_first_push"] = round(first["push_s"] / shm[0]["push_s"], 4)
    print(json.dumps({**summary, "models": results}))


if __name__ == "__main__":
    main()
