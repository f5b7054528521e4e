"""Seconds, GB/s and peak extra memory of a weight push from JAX params into a running vLLM
engine, against a plain memory copy of the same bytes in the same run.

The real path, as `tests/integration/test_engine_end_to_end.py` wires it: a gateway process
(`python -m gateway serve`), one engine process (`python -m rollout_engine --backend vllm`,
bf16 by default) started on the model's HF folder, and this process as the trainer holding the
model's fp32 JAX params and pushing them with `trainer.publish.WeightPublisher` over gloo
(cast to the wire dtype in JAX, mapping layout, buckets, broadcast, vLLM's layerwise reload,
prefix-cache reset). The engine serves a prompt before the pushes, and one at the last
version after them (its rollout must be stamped with that version).

Models: `smollm2` (the real SmolLM2-135M-Instruct, `trainer.checkpoints.smollm2`) and `0.5b`
(a random llama of 0.47B params written by `make_tiny_checkpoint`: D 1024, F 4096, 24 layers,
16 heads, 4 KV heads, V 49,152, untied). For each bucket size a fresh publisher (a new gloo
group) makes one warm-up push (group formation, first casts) and `--repeats` timed pushes.
Reference: right after each timed push, the median GB/s of 3 copies of the same number of bytes
between two preallocated torch buffers; `ratio_vs_memcpy` is the median over the pushes of push
GB/s / that memcpy GB/s (measured back to back, as the 2 shared cores' load changes).

Memory: before each timed push the peak-RSS counter (VmHWM) of this process and of every
process of the engine's tree (the CLI process, vLLM's EngineCore and, on CPU, its Worker, which
holds the model and the receiver) is reset (`/proc/PID/clear_refs` = 5, Linux >= 4.0); after
it, extra = VmHWM - VmRSS before. Engine extra is reported per process (max over pushes) and
summed over the tree (an upper bound: the peaks need not coincide).

Usage: python benchmarks/weight_sync.py [--models smollm2,0.5b] [--bucket-mb 256,64,16]
    [--repeats 2] [--dtype bfloat16]
Prints one line per push, then one JSON object on the last line: its top-level figures are the
first model at the first bucket size (256 MiB, the transport's default bucket), `models` holds
every model and bucket size (push seconds and GB/s are medians of the timed pushes, peak extra
MB the maximum over them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from gateway import messages as m
from gateway.auth import write_tokens
from gateway.client import GatewayClient
from gateway.transport.config import GlooTransportConfig
from trainer.checkpoints.hf_io import load_hf_checkpoint
from trainer.checkpoints.smollm2 import ensure_smollm2
from trainer.checkpoints.tiny import make_tiny_checkpoint
from trainer.models.params import flat_params
from trainer.publish import WeightPublisher

CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}
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
#: Prompt token ids, below both models' vocabulary (49,152).
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


def _wait_for(what: str, check, timeout_s: float, procs: list[subprocess.Popen], log: Path):
    end = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        dead = [p.args[2] for p in procs if p.poll() is not None]
        if dead or time.monotonic() > end:
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise RuntimeError(f"{what} did not happen (exited: {dead}):\n{tail}")
        time.sleep(0.2)


@contextlib.contextmanager
def engine_stack(workdir: Path, model_dir: Path, family: str, dtype: str, max_model_len: int):
    """A gateway process and one vLLM engine process on `model_dir`; yields (trainer client,
    engine process). Both processes are shut down (killed if need be) on exit."""
    tokens = workdir / "tokens.txt"
    write_tokens(tokens)
    port_file, gw_log, engine_log = workdir / "port", workdir / "gw.log", workdir / "engine.log"
    procs: list[subprocess.Popen] = []
    children: list[psutil.Process] = []  # the engine's vLLM processes, killed if left behind
    trainer = None
    try:
        gw_args = ["--token-file", str(tokens), "--port-file", str(port_file), "--family", family]
        gw_args += ["--dtype", dtype, "--transport", "gloo", "--log-level", "WARNING"]
        with open(gw_log, "w") as out:
            procs.append(
                subprocess.Popen([sys.executable, "-m", "gateway", "serve", *gw_args], stderr=out)
            )
        port = _wait_for(
            "gateway start", lambda: port_file.exists() and port_file.read_text(), 30, procs, gw_log
        ).strip()
        address = f"127.0.0.1:{port}"
        args = ["--backend", "vllm", "--gateway", address, "--token-file", str(tokens)]
        args += ["--model", str(model_dir), "--dtype", dtype, "--name", "bench"]
        args += ["--vllm-max-model-len", str(max_model_len), "--log-level", "WARNING"]
        with open(engine_log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "rollout_engine", *args],
                    env={**os.environ, **CPU_ENV},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
        trainer = GatewayClient.from_token_file(address, tokens, "trainer")
        _wait_for(
            "engine registration",
            lambda: len(trainer.status().engines) == 1,
            600,
            procs,
            engine_log,
        )
        children = psutil.Process(procs[1].pid).children(recursive=True)
        yield trainer, procs[1]
        trainer.shutdown("benchmark over")
        procs[1].wait(60)
    finally:
        if trainer is not None:
            trainer.close()
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(20)
        for c in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                if c.is_running():
                    c.kill()


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


def memcpy_gb_per_s(num_bytes: int, repeats: int = 3) -> float:
    """Median GB/s (1e9 bytes) of copying `num_bytes` between two preallocated torch buffers."""
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(times) / 1e9


def bench_model(label: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """Every bucket size's pushes of `model_dir` into one running engine (see the docstring)."""
    cfg, decoder = load_hf_checkpoint(model_dir, dtype="float32")
    params = flat_params(decoder)
    num_params = sum(int(np.prod(v.shape)) for v in params.values())
    rows, version = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        stack = engine_stack(Path(tmp), model_dir, cfg.family, args.dtype, 256)
        with stack as (trainer, engine):
            print(
                f"{label}: {num_params / 1e6:.1f} M params; engine up in "
                f"{time.perf_counter() - t0:.0f} s"
            )
            serve_one(trainer, f"{label}-before", 0)
            root = psutil.Process(engine.pid)
            tree = [root, *root.children(recursive=True)]
            pids = {"trainer": os.getpid()}
            pids |= {f"engine:{p.pid}:{_name(p)}": p.pid for p in tree}
            for mb in args.bucket_mb:
                transport = GlooTransportConfig(port=0, timeout_s=300, bucket_bytes=mb << 20)
                publisher = WeightPublisher(trainer, transport, cfg.family, cfg, args.dtype)
                try:
                    for r in range(args.repeats + 1):
                        version += 1
                        with PeakRss(pids) as peak:
                            stats = publisher.push(params, version)
                        tag = "warm-up" if r == 0 else "timed"
                        print(
                            f"  bucket {mb} MB v{version} ({tag}): {stats.seconds:.3f} s "
                            f"(ready {stats.ready_s:.3f}, send {stats.send_s:.3f}, loaded "
                            f"{stats.loaded_s:.3f}), {stats.gb_per_s:.3f} GB/s, "
                            f"{stats.num_buckets} buckets; peak extra MB "
                            f"{ {k: round(v) for k, v in peak.extra_mb.items()} }"
                        )
                        if r > 0:
                            memcpy = memcpy_gb_per_s(stats.num_bytes)
                            rows.append((mb, stats, peak.extra_mb, memcpy))
                finally:
                    publisher.close()
            serve_one(trainer, f"{label}-after", version)
    per_bucket = [_summary(mb, [r for r in rows if r[0] == mb]) for mb in args.bucket_mb]
    return {"params": num_params, "bytes": rows[0][1].num_bytes, "per_bucket": per_bucket}


def _name(p: psutil.Process) -> str:
    cmd = " ".join(p.cmdline())
    return "cli" if "rollout_engine" in cmd else p.name()


def _summary(mb: int, rows: list) -> dict:
    """One bucket size's figures from its timed pushes (bucket MiB, PushStats, peak extra MB by
    process, memcpy GB/s measured right after the push)."""
    secs = statistics.median(s.seconds for _, s, _, _ in rows)
    send = statistics.median(s.send_s for _, s, _, _ in rows)
    num_bytes = rows[0][1].num_bytes
    ratio = statistics.median(s.gb_per_s / c for _, s, _, c in rows)
    extra = {k: max(e[k] for _, _, e, _ in rows) for k in rows[0][2]}
    engine = {k: v for k, v in extra.items() if k.startswith("engine")}
    return {
        "bucket_mb": mb,
        "buckets": rows[0][1].num_buckets,
        "push_s": round(secs, 3),
        "push_gb_per_s": round(num_bytes / secs / 1e9, 3),
        "send_gb_per_s": round(num_bytes / send / 1e9, 3),
        "memcpy_gb_per_s": round(statistics.median(c for _, _, _, c in rows), 3),
        "ratio_vs_memcpy": round(ratio, 4),
        "trainer_peak_extra_mb": round(extra["trainer"], 1),
        "engine_peak_extra_mb": {k: round(v, 1) for k, v in engine.items()},
        "engine_tree_peak_extra_mb": round(sum(engine.values()), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm2", help="comma-separated: smollm2, 0.5b")
    parser.add_argument("--bucket-mb", default="256,64,16", help="comma-separated bucket MiB")
    parser.add_argument("--repeats", type=int, default=2, help="timed pushes per bucket size")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    args.bucket_mb = [int(x) for x in args.bucket_mb.split(",")]
    models = [x for x in args.models.split(",") if x]
    unknown = set(models) - {"smollm2", "0.5b"}
    if unknown or not models or args.repeats < 1:
        parser.error(f"--models takes smollm2 and/or 0.5b (got {models}); --repeats >= 1")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            if name == "smollm2":
                path = ensure_smollm2()
            else:
                path = make_tiny_checkpoint(
                    Path(tmp) / "llama05b", "llama", dtype="bfloat16", **LLAMA_05B
                )
            results[name] = bench_model(name, path, args)
    first = results[models[0]]["per_bucket"][0]
    summary = {"model": models[0], "dtype": args.dtype, **first}
    print(json.dumps({**summary, "models": results}))


if __name__ == "__main__":
    main()
