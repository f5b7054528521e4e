"""Weight pushes of the real main job with the trainer as 1 or several processes (fan-in), against
a memcpy and a raw gloo broadcast of the same bytes measured in the same run.

For each P of `--trainer-processes` (`benchmarks/weight_sync.py --trainer-processes 1,2`) the
main job runs (``python -m trainer train --config configs/smollm2_arith.yaml``, SmolLM2 into one
vLLM bf16 engine over gloo) with `launch.trainer_processes` P and `launch.trainer_devices`
D / P, so the FSDP mesh has the same D devices every time (one process holding all, or P
processes each holding 1/P). The rollouts are cut small (2 prompts x 2 completions of 16 tokens)
so the steps are short; the figures are the pushes of steps 2..N (step 1's push forms the data-
plane group): from process 0's metrics rows `sync_time_s` (the whole push: blocks made in JAX,
plan, ready, send, loaded) and `sync_sent_bytes`, and from ``logs/trainer<i>_sends.jsonl`` what
each other process sent. With `--data-plane gloo,jax_transfer` the same jobs run over each
data plane into the JAX engine (bf16; jax_transfer serves JAX engines only), and
`jax_transfer_over_gloo_by_processes` is gloo's push seconds over jax_transfer's at each P.
References, measured after the jobs in this process: the memcpy GB/s
of the version's bytes (`common.memcpy_gb_per_s`) and a bare gloo broadcast of them to a child
process (`common.gloo_reference`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def run_job(
    processes: int,
    devices: int,
    steps: int,
    run_dir: Path,
    env: dict,
    data_plane: str = "gloo",
    backend: str = "vllm",
) -> dict:
    """One main job with `processes` trainer processes over `devices` devices in all, pushing
    over `data_plane` into one `backend` engine (bf16); returns its push figures (see the
    module docstring).

    Raises:
        RuntimeError: the job failed (its stderr's tail in the message).
    """
    if devices % processes:
        raise ValueError(f"{devices} devices do not split over {processes} trainer processes")
    cmd = [
        sys.executable, "-m", "trainer", "train", "--config", "configs/smollm2_arith.yaml",
        f"run_dir={run_dir}", "launch.progress=false", f"trainer.steps={steps}",
        f"launch.trainer_processes={processes}", f"launch.trainer_devices={devices // processes}",
        "rollout.group_size=2", "trainer.prompts_per_step=2",
        "trainer.micro_batches=1", "rollout.max_new_tokens=16", "eval.size=0",
        "trainer.checkpoint_every=0", f"launch.data_plane={data_plane}",
        f"rollout.backend={backend}", "launch.engine_dtype=bfloat16",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the job with {processes} trainer processes over {data_plane} "
                           f"failed: {done.stderr[-3000:]}")  # fmt: skip
    figures = push_figures(run_dir, processes)
    return {**figures, "devices_per_process": devices // processes, "data_plane": data_plane,
            "engine": backend}  # fmt: skip


def push_figures(run_dir: Path, processes: int) -> dict:
    """The push figures of a finished job's run folder: steps 2..N of process 0's
    metrics.jsonl and each other process's ``logs/trainer<i>_sends.jsonl``.

    Raises:
        KeyError: a process logged no send of a version process 0 pushed.
        ValueError: fewer than 2 steps.
    """
    metrics = _rows(run_dir / "metrics.jsonl")[1:]  # step 1's push forms the group
    if not metrics:
        raise ValueError(f"{run_dir}: fewer than 2 steps in metrics.jsonl")
    others = {
        p: {r["version"]: r for r in _rows(run_dir / "logs" / f"trainer{p}_sends.jsonl")}
        for p in range(1, processes)
    }
    sent = {0: [r["sync_sent_bytes"] for r in metrics]}
    for p, by_version in others.items():
        sent[p] = [by_version[r["version"]]["num_bytes"] for r in metrics]
    total = [sum(s[i] for s in sent.values()) for i in range(len(metrics))]
    push_s = statistics.median(r["sync_time_s"] for r in metrics)
    return {
        "trainer_processes": processes,
        "pushes": len(metrics),
        "push_s": round(push_s, 3),
        "sent_bytes_by_process": {str(p): int(statistics.median(v)) for p, v in sent.items()},
        "sent_fraction_by_process": {
            str(p): round(statistics.median(v[i] / total[i] for i in range(len(total))), 4)
            for p, v in sent.items()
        },
        "version_bytes": int(statistics.median(total)),
    }


def bench_trainer_processes(
    counts: list[int],
    steps: int,
    tmp: Path,
    env: dict,
    references: Any,
    data_planes: tuple[str, ...] = ("gloo",),
) -> dict:
    """Run the job for each data plane of `data_planes` and count of `counts` (devices: the
    largest count, so each process holds at least one) and add the references
    (`references(num_bytes)` -> {"memcpy_gb_per_s", "raw_gloo_gb_per_s"}) of the version's
    bytes; returns {"runs": [...], figures}. The engine is vLLM, or the JAX engine for every
    run when jax_transfer is among `data_planes` (it serves JAX engines only), so the data
    planes are compared on one engine."""
    devices = max(counts)
    backend = "jax" if "jax_transfer" in data_planes else "vllm"
    runs = [
        run_job(p, devices, steps, tmp / f"{dp}-p{p}", env, dp, backend)
        for dp in data_planes for p in counts
    ]  # fmt: skip
    num_bytes = runs[0]["version_bytes"]
    ref = references(num_bytes)
    for r in runs:
        gb = r["version_bytes"] / r["push_s"] / 1e9
        r["push_gb_per_s"] = round(gb, 3)
        r["push_over_memcpy"] = round(gb / ref["memcpy_gb_per_s"], 4)
        r["push_over_raw_gloo"] = round(gb / ref["raw_gloo_gb_per_s"], 4)
    out: dict[str, Any] = {"runs": runs, **{k: round(v, 3) for k, v in ref.items()}}
    if len(counts) > 1:  # of the first data plane
        out["push_s_one_over_many"] = round(runs[0]["push_s"] / runs[len(counts) - 1]["push_s"], 4)
    if "jax_transfer" in data_planes and "gloo" in data_planes:  # same P, same engine
        by = {(r["data_plane"], r["trainer_processes"]): r["push_s"] for r in runs}
        out["jax_transfer_over_gloo_by_processes"] = {
            str(p): round(by[("gloo", p)] / by[("jax_transfer", p)], 4) for p in counts
        }
    return out
