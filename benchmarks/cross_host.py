"""What real interfaces cost: the main job on a cluster in a box against the same on loopback.

For each config (``--configs``; default the smoke job, configs/smoke.yaml with the JAX engine,
and the SmolLM2 main job, configs/smollm2_arith.yaml with vLLM in bf16), in one run:
- loopback: ``python -m trainer train --config C`` (the launcher starts the gateway, one
  engine and the trainer, all on 127.0.0.1);
- box: the same job across two hosts of a cluster in a box (`deploy.local.cluster_box`,
  network namespaces on a bridge, each host's firewall admitting only its port table): the
  gateway (TLS) and the trainer on node0, the engine on node1, every weight push over gloo
  across the veth pair (`deploy.local.hosts_job.MainJobOnHosts`).
Each runs ``--steps`` steps (default 5) with no held-out evaluation.

Figures per config and layout, medians over steps 2..N (step 1 compiles): ``step_s`` (the
loop's ``total_time_s``: collecting groups, the train step and the push), ``push_s`` (its
``sync_time_s``: the version's push to every engine, commit included); and the ratios
``box_over_loopback_step_s`` and ``box_over_loopback_push_s``. The host's CPU (model, AVX-512 /
AMX flags) is printed with them: the box's links are the kernel's veth pairs, so the ratio is
the cost of real interfaces, TLS and a firewall on this host, not of a physical network.

Needs root and iproute2 (it makes network namespaces; every one is removed on exit). Run:
``flock /tmp/jaxrl-heavy.lock .venv/bin/python benchmarks/cross_host.py``. Prints one line per
run and, as the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: deploy/ is no package
from deploy.local.cluster_box import ClusterBox  # noqa: E402
from deploy.local.hosts_job import REPO, MainJobOnHosts, child_env  # noqa: E402

CONFIGS = {"smoke": "configs/smoke.yaml", "smollm2": "configs/smollm2_arith.yaml"}


def host_cpu() -> dict[str, object]:
    """The CPU's model name and whether it has AVX-512 (avx512f), AVX-512 BF16 and AMX."""
    info = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), "unknown")  # fmt: skip
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                      if ln.startswith("flags")), []))  # fmt: skip
    return {"cpu": model, "cores": os.cpu_count(), "avx512f": "avx512f" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags}  # fmt: skip


def medians(run_dir: Path) -> dict[str, float]:
    """Median step and push seconds of metrics.jsonl over steps 2..N.

    Raises:
        RuntimeError: fewer than 2 steps were written.
    """
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if len(rows) < 2:
        raise RuntimeError(f"{run_dir}: {len(rows)} steps written, need at least 2")
    later = rows[1:]
    return {
        "steps": len(rows),
        "step_s": statistics.median(r["total_time_s"] for r in later),
        "push_s": statistics.median(r["sync_time_s"] for r in later),
    }


def on_loopback(config: str, steps: int, tmp: Path, cache: Path) -> dict[str, float]:
    """The job on 127.0.0.1 through the launcher; returns `medians`.

    Raises:
        RuntimeError: the job exited non-zero (its stderr's tail inside).
    """
    run_dir = tmp / f"loopback-{Path(config).stem}"
    argv = [sys.executable, "-m", "trainer", "train", "--config", config, f"run_dir={run_dir}",
            f"trainer.steps={steps}", "eval.size=0", "launch.progress=false"]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, env=child_env(cache), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"loopback {config} exited {done.returncode}: {done.stderr[-3000:]}")
    return medians(run_dir)


def in_box(config: str, steps: int, tmp: Path, cache: Path) -> dict[str, float]:
    """The job on two hosts of a cluster in a box (trainer and gateway on node0, the engine on
    node1, firewalls on); returns `medians`.

    Raises:
        RuntimeError: a process exited early or the trainer exited non-zero.
    """
    run_dir = tmp / f"box-{Path(config).stem}"
    with ClusterBox(["node0", "node1"]) as box:
        job = MainJobOnHosts(
            box, run_dir, cache, trainer_hosts=["node0"], engine_hosts=["node1"],
            overrides=[f"trainer.steps={steps}", "eval.size=0"], config=REPO / config,
        )  # fmt: skip
        try:
            job.start()
            codes = job.wait_trainers(3600)
        finally:
            job.stop()
        if codes != [0]:
            raise RuntimeError(
                f"box {config}: trainer exited {codes}: {job.log('trainer0')[-3000:]}"
            )
    return medians(run_dir)


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run every config on loopback and in the box; print and return the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="smoke,smollm2", help=f"of {sorted(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cache", default="", help="JAXRL_CACHE_DIR (default: the usual one)")
    args = ap.parse_args(argv)
    from models.checkpoints.smollm2 import cache_dir

    cache = Path(args.cache) if args.cache else cache_dir()
    out: dict[str, object] = {"host": host_cpu(), "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="cross-host-") as tmp:
        for name in args.configs.split(","):
            config = CONFIGS[name]
            t0 = time.monotonic()
            lo = on_loopback(config, args.steps, Path(tmp), cache)
            print(f"{name} loopback: {lo} ({time.monotonic() - t0:.0f} s)", flush=True)
            t0 = time.monotonic()
            bx = in_box(config, args.steps, Path(tmp), cache)
            print(f"{name} box: {bx} ({time.monotonic() - t0:.0f} s)", flush=True)
            out[name] = {
                "loopback": lo, "box": bx,
                "box_over_loopback_step_s": bx["step_s"] / lo["step_s"],
                "box_over_loopback_push_s": bx["push_s"] / lo["push_s"],
            }  # fmt: skip
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
