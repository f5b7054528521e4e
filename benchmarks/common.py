"""Pieces several benchmarks share: the model folder by name, the memcpy reference and the
environment of a vLLM engine on this machine's CPUs.

Imported by the scripts beside it (`python benchmarks/<name>.py` puts this folder first on
`sys.path`).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

#: What a vLLM CPU engine needs here (2 cores): 1 GiB of KV cache, its OpenMP threads bound
#: to both cores and no core reserved for vLLM's scheduler process (vLLM's "auto" binding
#: reserves one core per TP rank on x86, which leaves the engine one of the 2 cores).
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


def model_path(name: str, tmp: Path) -> Path:
    """The HF folder of ``name``: "tiny" (a random tiny llama), "smollm2", or a folder."""
    if name == "tiny":
        from models.checkpoints.tiny import make_tiny_checkpoint

        return make_tiny_checkpoint(tmp / "tiny", "llama", vocab_size=320)
    if name == "smollm2":
        from models.checkpoints.smollm2 import ensure_smollm2

        return ensure_smollm2()
    return Path(name)


def memcpy_gb_per_s(num_bytes: int, repeats: int = 3) -> float:
    """Median GB/s (1e9 bytes) of copying `num_bytes` between two preallocated torch buffers
    (pages touched once before timing): the host-memory reference of the weight benchmarks."""
    import torch

    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(times) / 1e9


def _gloo_peer(port: int, sizes: list[int], repeats: int, manifests: list[dict]) -> None:
    """The receiving side of `gloo_reference` (a child process): rank 1 of a bare gloo group
    taking rounds of one broadcast per size of `sizes` into preallocated buffers, and rank 1
    of the project's gloo transport (`transport.gloo.GlooReceiver`, the store at `port` + 1)
    receiving each of `manifests` into a callback that drops the buckets: the first manifest
    (the warm-up) alone, then raw round i and manifest i + 1 in turn (`_rounds`)."""
    import torch

    from transport.gloo import GlooReceiver
    from transport.manifest import Manifest

    pg = _bare_gloo_group(port, 1)
    bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    receiver = GlooReceiver("127.0.0.1", port + 1, 1, 2, timeout_s=120)
    try:
        receiver.receive(Manifest.from_dict(manifests[0]), lambda bucket: None)
        for raw, send in _rounds(repeats, len(manifests) - 1):
            if raw:
                cpu0 = time.process_time()
                for b in bufs:
                    _bare_broadcast(pg, b)
                # the round's CPU seconds back to the root (/proc's 10 ms ticks: too coarse)
                cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)
                _bare_broadcast(pg, cpu, 1)
            if send is not None:
                receiver.receive(Manifest.from_dict(manifests[send + 1]), lambda bucket: None)
    finally:
        receiver.close()
        del pg


def _rounds(repeats: int, sends: int) -> list[tuple[bool, int | None]]:
    """The order of `gloo_reference`'s timed rounds: round i is a raw broadcast round (while
    i < `repeats`), then timed send i (while i < `sends`), so that the two are measured in
    turn under the same load of the shared cores, not one phase after the other (one run's
    raw broadcast read 2.86 GB/s and the next one's 1.60 on the same host)."""
    return [(i < repeats, i if i < sends else None) for i in range(max(repeats, sends))]


def _bare_gloo_group(port: int, rank: int):
    """A 2-rank torch gloo process group on 127.0.0.1 (its own TCPStore at `port`)."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _bare_broadcast(pg, t, root: int = 0) -> None:
    """Broadcast tensor `t` from rank `root` of the bare gloo group `pg` and wait for it."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([t], opts).wait()


def _free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (checked, then released)."""
    import socket

    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
            return int(p)
    raise OSError("no two adjacent free ports on 127.0.0.1")


def gloo_reference(manifests: list, tensors, repeats: int = 3) -> dict[str, float]:
    """The gloo references of a weight push, measured against a child process on loopback.

    Args:
        manifests: at least 2 `transport.manifest.Manifest`s of the same layout (their
            versions differ), one per send: the first is a warm-up (it forms the group), the
            rest are timed; the bytes and buckets of the first set the raw rounds.
        tensors: a callable returning, for each send, a fresh (name, array) iterable in
            manifest order (what `WeightSender.send` takes: e.g. fp32 JAX params mapped to
            the HF layout, cast while packed).
        repeats: rounds of the raw broadcast.

    Returns:
        `raw_gloo_gb_per_s`: the median GB/s (1e9 bytes) of `repeats` rounds of a bare torch
        gloo broadcast of the same bytes, one broadcast per bucket from preallocated buffers
        (nothing packed, nothing loaded: the wire alone); `transport_gb_per_s`: the median
        GB/s of the project's `GlooSender.send` of each manifest after the first, in turn
        with the raw rounds (`_rounds`) (packing from `tensors`,
        the pipelined broadcast, the commit) into a receiver that drops the buckets: what
        the data plane costs without an engine's load; `pack_gb_per_s`: the median GB/s of
        packing alone (`transport.base.iter_packed` from `tensors` into the sender's kind of
        reused buffers: the mapping's layout, the cast, the copy; nothing sent), measured
        `repeats` times after one untimed pass. Packing and the wire share the same cores
        here, so a push cannot beat 1 / (1 / pack + 1 / raw) unless they overlap.
        `raw_gloo_cpu_s_per_gb`: CPU seconds (user + system, every thread of both processes)
        the raw rounds took per GB, and `raw_gloo_cores` those CPU seconds over the rounds'
        wall seconds (how many cores the wire alone keeps busy); `pack_cpu_s_per_gb` likewise
        for the packing rounds. With `host_cores` cores, no push of these bytes (packing plus
        the wire, the engine's load not counted) can beat
        `host_ceiling_over_raw_gloo` = raw s / max(raw s, (raw CPU s + pack CPU s) / cores) of
        the raw broadcast, however well the stages overlap.
    """
    import multiprocessing

    import torch

    from transport.base import BufferPool, iter_packed
    from transport.collective import PIPELINE_DEPTH
    from transport.gloo import GlooSender
    from transport.manifest import bucket_layout

    if len(manifests) < 2:
        raise ValueError(
            f"expected at least 2 manifests (a warm-up and a timed send), got {len(manifests)}"
        )
    first = manifests[0]
    sizes = [bucket_layout(first, b)[1] for b in first.buckets()]
    port = _free_port_pair()
    ctx = multiprocessing.get_context("spawn")
    peer = ctx.Process(
        target=_gloo_peer, args=(port, sizes, repeats, [m.to_dict() for m in manifests])
    )
    peer.start()
    try:
        pg = _bare_gloo_group(port, 0)
        if peer.pid is None:
            raise RuntimeError("the gloo reference's receiver did not start")
        pool = BufferPool("cpu")
        packs = []
        for i in range(repeats + 1):
            if i == 1:
                pack_cpu0 = time.process_time()
            t0 = time.perf_counter()
            for _buf in iter_packed(first, tensors(), "cpu", pool, PIPELINE_DEPTH):
                pass
            packs.append(time.perf_counter() - t0)
        pack_cpu = time.process_time() - pack_cpu0
        del pool
        bufs = [torch.ones(n, dtype=torch.uint8) for n in sizes]
        peer_cpu = torch.empty(1, dtype=torch.float64)
        raw, raw_cpu, sends = [], 0.0, []
        sender = GlooSender("127.0.0.1", port + 1, 1, timeout_s=120)
        try:
            sender.send(first, tensors())  # forms the group: a warm-up, not timed
            for is_raw, send in _rounds(repeats, len(manifests) - 1):
                if is_raw:
                    cpu0, t0 = time.process_time(), time.perf_counter()
                    for b in bufs:
                        _bare_broadcast(pg, b)
                    _bare_broadcast(pg, peer_cpu, 1)  # the receiver holds the round: its CPU s
                    raw.append(time.perf_counter() - t0)
                    raw_cpu += time.process_time() - cpu0 + float(peer_cpu[0])
                if send is not None:
                    sends.append(sender.send(manifests[send + 1], tensors()).seconds)
        finally:
            sender.close()
            del pg, bufs
        peer.join(120)
    finally:
        if peer.is_alive():
            peer.kill()
            peer.join()
    if peer.exitcode != 0:
        raise RuntimeError(f"the gloo reference's receiver exited with {peer.exitcode}")
    gb = first.total_bytes / 1e9
    cores = len(os.sched_getaffinity(0))
    raw_s = sum(raw) / repeats
    raw_cpu_s, pack_cpu_s = raw_cpu / repeats, pack_cpu / repeats
    return {
        "raw_gloo_gb_per_s": gb / statistics.median(raw),
        "transport_gb_per_s": gb / statistics.median(sends),
        "pack_gb_per_s": gb / statistics.median(packs[1:]),
        "raw_gloo_cpu_s_per_gb": raw_cpu_s / gb,
        "raw_gloo_cores": raw_cpu_s / raw_s,
        "pack_cpu_s_per_gb": pack_cpu_s / gb,
        "host_cores": cores,
        "host_ceiling_over_raw_gloo": raw_s / max(raw_s, (raw_cpu_s + pack_cpu_s) / cores),
    }


def compiled_temp_and_seconds(jitted: Any, args: tuple, repeats: int) -> dict[str, float]:
    """XLA's planned temporary bytes (``memory_analysis().temp_size_in_bytes``: every
    intermediate buffer, inputs and outputs excluded; on CPU the honest peak) and the median
    seconds of `repeats` runs after a warm-up, of the jitted function on `args`.

    Raises:
        RuntimeError: the backend reports no memory analysis.
    """
    import jax

    compiled = jitted.lower(*args).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise RuntimeError("this backend reports no memory analysis of compiled programs")
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return {"temp_bytes": int(analysis.temp_size_in_bytes), "seconds": statistics.median(times)}
