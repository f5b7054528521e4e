"""Gateway throughput: completions/s and p50/p99 latency of submit, lease, return and fetch.

One trainer (a submit thread and a fetch loop) and `--engines` engine threads move prompts
with G completions of 256 and of 4,096 tokens (int32 ids + float32 log-probs) through a real
gateway process on loopback, then through plain in-process `queue.Queue`s doing the same
hand-offs (the reference). Engines "generate" instantly (pre-built arrays), so the figure is
the control plane's own ceiling. The last line is one JSON object; `ratio` is gateway
completions/s over queue.Queue completions/s.

Usage: python benchmarks/gateway_throughput.py [--prompts-256 N] [--prompts-4096 N]
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from gateway import messages as m
from gateway.auth import write_tokens
from gateway.client import GatewayClient

G = 4
SUBMIT_BATCH = 32
LEASE_SIZE = 8
FETCH_MAX = 64


def _percentiles(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        op: {
            "p50_ms": round(float(np.percentile(v, 50)) * 1e3, 3),
            "p99_ms": round(float(np.percentile(v, 99)) * 1e3, 3),
            "calls": len(v),
        }
        for op, v in samples.items()
    }


def _prompts(n: int, length: int) -> list[m.Prompt]:
    sampling = m.SamplingParams(max_new_tokens=length)
    tokens = np.arange(1, 65, dtype=np.int32)  # a 64-token prompt
    return [m.Prompt(f"p{i}", tokens, G, sampling) for i in range(n)]


def _completions(length: int) -> tuple[m.Completion, ...]:
    rng = np.random.default_rng(0)
    return tuple(
        m.Completion(
            rng.integers(0, 150_000, length, dtype=np.int32),
            -rng.random(length, dtype=np.float32),
            "length",
            0,
            0,
        )
        for _ in range(G)
    )


def _timed(samples: list[float], fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    samples.append(time.perf_counter() - t0)
    return out


def run_gateway(address: str, tokens: Path, n: int, length: int, engines: int) -> dict:
    """Move n prompts x G completions of `length` tokens through the gateway at `address`."""
    prompts, done = _prompts(n, length), _completions(length)
    lat: dict[str, list[float]] = defaultdict(list)
    trainer = GatewayClient.from_token_file(address, tokens, "trainer", margin_s=60)
    finished = threading.Event()

    def engine_loop() -> None:
        client = GatewayClient.from_token_file(address, tokens, "engine", margin_s=60)
        spec = m.EngineSpec("jax", "bench", "float32", ("gloo",))
        eid = client.register_engine(spec).engine_id
        mine: dict[str, list[float]] = defaultdict(list)
        while not finished.is_set():
            t0 = time.perf_counter()
            lease = client.lease_prompts(eid, LEASE_SIZE, 0.2)
            if lease.prompts:  # idle waits at the end are not hand-offs
                mine["lease"].append(time.perf_counter() - t0)
                groups = [m.RolloutGroup(p.sample_id, done) for p in lease.prompts]
                _timed(mine["return"], client.return_rollouts, eid, lease.lease_id, groups)
        client.deregister(eid)
        client.close()
        for op, v in mine.items():
            lat[op].extend(v)

    def submit_loop() -> None:
        for i in range(0, n, SUBMIT_BATCH):
            _timed(lat["submit"], trainer.submit_prompts, prompts[i : i + SUBMIT_BATCH], 60.0)

    threads = [threading.Thread(target=engine_loop) for _ in range(engines)]
    threads.append(threading.Thread(target=submit_loop))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    got = 0
    while got < n:
        got += len(_timed(lat["fetch"], trainer.fetch_rollouts, FETCH_MAX, 30.0))
    seconds = time.perf_counter() - t0
    finished.set()
    for t in threads:
        t.join()
    trainer.close()
    return {"completions_per_s": round(n * G / seconds, 1), "seconds": round(seconds, 3),
            "latency": _percentiles(lat)}  # fmt: skip


def run_queue(n: int, length: int, engines: int) -> dict:
    """The same hand-offs through two in-process queue.Queues (prompts in, groups out)."""
    prompts, done = _prompts(n, length), _completions(length)
    lat: dict[str, list[float]] = defaultdict(list)
    q_in: queue.Queue = queue.Queue()
    q_out: queue.Queue = queue.Queue(maxsize=4096)
    finished = threading.Event()

    def lease() -> list[m.Prompt]:
        try:
            out = [q_in.get(timeout=0.2)]
        except queue.Empty:
            return []
        while len(out) < LEASE_SIZE:
            try:
                out.append(q_in.get_nowait())
            except queue.Empty:
                break
        return out

    def give_back(groups: list[m.RolloutGroup]) -> None:
        for g in groups:
            q_out.put(g)

    def fetch() -> list[m.RolloutGroup]:
        out = [q_out.get(timeout=30.0)]
        while len(out) < FETCH_MAX:
            try:
                out.append(q_out.get_nowait())
            except queue.Empty:
                break
        return out

    def engine_loop() -> None:
        mine: dict[str, list[float]] = defaultdict(list)
        while not finished.is_set():
            t0 = time.perf_counter()
            leased = lease()
            if leased:
                mine["lease"].append(time.perf_counter() - t0)
                groups = [m.RolloutGroup(p.sample_id, done) for p in leased]
                _timed(mine["return"], give_back, groups)
        for op, v in mine.items():
            lat[op].extend(v)

    def _put_all(batch: list[m.Prompt]) -> None:
        for p in batch:
            q_in.put(p)

    def submit_loop() -> None:
        for i in range(0, n, SUBMIT_BATCH):
            _timed(lat["submit"], _put_all, prompts[i : i + SUBMIT_BATCH])

    threads = [threading.Thread(target=engine_loop) for _ in range(engines)]
    threads.append(threading.Thread(target=submit_loop))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    got = 0
    while got < n:
        got += len(_timed(lat["fetch"], fetch))
    seconds = time.perf_counter() - t0
    finished.set()
    for t in threads:
        t.join()
    return {"completions_per_s": round(n * G / seconds, 1), "seconds": round(seconds, 3),
            "latency": _percentiles(lat)}  # fmt: skip


def main() -> None:
    """Run both lengths through the gateway and through queue.Queue; print the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts-256", type=int, default=2000)
    parser.add_argument("--prompts-4096", type=int, default=400)
    parser.add_argument("--engines", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokens, port_file = Path(tmp) / "tokens", Path(tmp) / "port"
        write_tokens(tokens)
        server = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--port", "0", "--port-file",
             str(port_file), "--token-file", str(tokens), "--family", "bench",
             "--max-message-mb", "256", "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            while not port_file.exists():
                time.sleep(0.01)
            address = f"127.0.0.1:{port_file.read_text()}"
            results = {}
            for length, n in ((256, args.prompts_256), (4096, args.prompts_4096)):
                gw = run_gateway(address, tokens, n, length, args.engines)
                ref = run_queue(n, length, args.engines)
                results[f"tokens_{length}"] = {
                    "prompts": n,
                    "gateway": gw,
                    "queue_queue": ref,
                    "ratio": round(gw["completions_per_s"] / ref["completions_per_s"], 4),
                }
                print(
                    f"{length:>5} tokens: gateway {gw['completions_per_s']:.0f} completions/s, "
                    f"queue.Queue {ref['completions_per_s']:.0f}/s, "
                    f"ratio {results[f'tokens_{length}']['ratio']:.3f}",
                    file=sys.stderr,
                )
        finally:
            server.terminate()
            server.wait(10)
    print(json.dumps({"benchmark": "gateway_throughput", "group_size": G, "results": results}))


if __name__ == "__main__":
    main()
