"""Far engines that generate (issue 26 item 5): the real main job on a cluster in a box with
``launch.data_plane=delta_stream``, one JAX engine per link rate class, against the same job
with the near engine only, in one invocation.

Two runs, one box (`deploy.local.cluster_box`; hosts ``trainer``, ``near``, ``far100``,
``far20``), each the smoke job (configs/smoke.yaml: GRPO on chain_sum, JAX engines) laid out by
`deploy.local.hosts_job.MainJobOnHosts` (gateway and trainer on ``trainer``, one engine per
further host, every process started with the launcher's own command lines):
- ``far``: engines on ``near`` (unlimited link), ``far100`` (``tc tbf`` 100 Mbit/s) and
  ``far20`` (20 Mbit/s), every one fed over the delta stream from the trainer's host;
- ``near_only``: the engine on ``near`` alone (the trainer's reference).

Figures per link rate class (``unlimited``, ``100``, ``20`` Mbit/s), from the job's own records:
``job_summary.json``'s ``delta_pushes`` (bytes on the wire of keyframes and deltas against the
full bf16 payload, seconds from request to ack), the gateway's events (``published`` and
``loaded``: each engine's lag, the trainer's newest published version minus the engine's
loaded one at every publication, and the versions it never loaded) and ``metrics.jsonl``
(``idle_fraction``: the trainer's share of a step spent waiting for rollouts, and
``total_time_s``: a step's seconds, medians over steps 2..N). Last line one JSON object.

Needs root, iproute2, nft and tc. Run: ``flock /tmp/jaxrl-helpers.lock .venv/bin/python
benchmarks/far_engines.py --generate [--model tiny|small|smollm2] [--steps 20]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: deploy/ is no package
from deploy.local.cluster_box import ClusterBox  # noqa: E402
from deploy.local.hosts_job import MainJobOnHosts  # noqa: E402

RATES: dict[str, float | None] = {"near": None, "far100": 100.0, "far20": 20.0}
"""Engine hosts and their link rates in Mbit/s (None: unlimited) in the ``far`` run."""
CLASS = {"near": "unlimited", "far100": "100", "far20": "20"}
"""Link rate class of each engine host."""
MODELS = {"tiny": "tiny:smollm2", "small": "tiny:smollm2", "smollm2": "smollm2"}
"""--model to model.path (``small`` has no main-job model of its own: the tiny one)."""


def _rows(path: Path) -> list[dict]:
    """The rows of a JSONL file (none when it is absent)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_job(box: ClusterBox, name: str, engines: list[str], args: argparse.Namespace,
            tmp: Path) -> dict:  # fmt: skip
    """One main job on `box` with engines on `engines` (each rate-limited per `RATES`); returns
    its summary, metrics rows and gateway events.

    Raises:
        RuntimeError: a process of the job exited early or the trainer failed.
        TimeoutError: the trainer did not end within ``args.timeout_s``.
    """
    for host in engines:
        box.limit_rate(host, RATES[host])
    job = MainJobOnHosts(
        box, tmp / name, tmp / "cache", trainer_hosts=["trainer"], engine_hosts=engines,
        overrides=[
            f"model.path={MODELS[args.model]}", f"trainer.steps={args.steps}", "eval.size=0",
            "rollout.backend=jax", "launch.data_plane=delta_stream",
            f"launch.data_plane_timeout_s={args.timeout_s}", f"rollout.max_lag={args.max_lag}",
            "trainer.checkpoint_every=0",
        ],
    )  # fmt: skip
    try:
        job.start()
        codes = job.wait_trainers(args.timeout_s)
        if codes != [0]:
            raise RuntimeError(
                f"{name}: trainer ended with {codes}:\n{job.log('trainer0')[-3000:]}"
            )
        return {
            "summary": job.result(),
            "metrics": _rows(job.run_dir / "metrics.jsonl"),
            "events": job.events(),
        }
    finally:
        job.stop()


def host_of(engine: str) -> str:
    """The host of an engine named ``engineI-HOST...`` (`MainJobOnHosts` names them so)."""
    return next((h for h in RATES if f"-{h}" in engine), engine)


def lags(events: list[dict]) -> dict[str, dict]:
    """Per engine (its name's host part): at each ``published`` version v, v minus the version
    the engine had loaded by then (a Counter of lag values), and the versions it never loaded.
    """
    held: dict[str, int] = {}
    counts: dict[str, Counter] = {}
    loaded: dict[str, set[int]] = {}
    published: list[int] = []
    for e in events:
        if e["event"] == "loaded":
            host = host_of(e["engine"])
            held[host] = max(held.get(host, 0), int(e["version"]))
            loaded.setdefault(host, set()).add(int(e["version"]))
        elif e["event"] == "published":
            v = int(e["version"])
            published.append(v)
            for host, h in held.items():
                counts.setdefault(host, Counter())[v - h] += 1
    return {
        host: {
            "lag": dict(sorted(counts.get(host, Counter()).items())),
            "versions_skipped": sorted(set(published) - loaded.get(host, set())),
        }
        for host in held
    }


def pushes(summary: dict) -> dict[str, dict]:
    """Per engine host: median wire bytes and seconds of its delta and keyframe pushes
    (``delta_pushes`` records of loaded versions) and their counts."""
    out: dict[str, dict] = {}
    for host in RATES:
        mine = [p for p in summary["delta_pushes"] if p["loaded"] and host_of(p["engine"]) == host]
        deltas = [p for p in mine if p["base"] is not None]
        keys = [p for p in mine if p["base"] is None]

        def med(xs: list[dict], k: str) -> float | None:
            return statistics.median(p[k] for p in xs) if xs else None

        out[host] = {
            "deltas": len(deltas), "keyframes": len(keys),
            "delta_bytes": med(deltas, "wire_bytes"), "keyframe_bytes": med(keys, "wire_bytes"),
            "delta_s": med(deltas, "seconds"), "keyframe_s": med(keys, "seconds"),
            "full_bf16_bytes": med(mine, "payload_bytes"),
        }  # fmt: skip
    return out


def idle(metrics: list[dict], key: str = "idle_fraction") -> float:
    """Median of `key` (``idle_fraction``, or ``total_time_s``: a step's seconds) over steps
    2..N (step 1 waits for the engines' start)."""
    xs = [r[key] for r in metrics if r["step"] >= 2] or [float("nan")]
    return float(statistics.median(xs))


def main(args: argparse.Namespace) -> None:
    """Both runs in one box; prints one line per run and link class, then the JSON object."""
    from cross_host import host_cpu

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, ClusterBox(["trainer", *RATES]) as box:
        for name, engines in (("far", list(RATES)), ("near_only", ["near"])):
            t0 = time.perf_counter()
            runs[name] = run_job(box, name, engines, args, Path(tmp))
            print(f"run {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    push = pushes(runs["far"]["summary"])
    lag = lags(runs["far"]["events"])
    links = {CLASS[h]: {**push[h], **lag.get(h, {})} for h in RATES}
    for rate, fig in links.items():
        print(f"link {rate}: {json.dumps(fig)}", flush=True)
    idles = {k: idle(v["metrics"]) for k, v in runs.items()}
    step_s = {k: idle(v["metrics"], "total_time_s") for k, v in runs.items()}
    print(json.dumps({
        "benchmark": "far_engines_generate", "model": MODELS[args.model], "steps": args.steps,
        "engine_backend": "jax", "max_lag": args.max_lag, "links": links,
        "idle_fraction": idles,
        "far_idle_over_near_only": idles["far"] / max(idles["near_only"], 1e-9),
        "step_s": step_s, "far_over_near_only_step_s": step_s["far"] / step_s["near_only"],
        **host_cpu(),
    }))  # fmt: skip
