"""Issue 13 item 1 (first slice): the smoke main job with ``launch.trainer_processes=2``
(2 trainer processes x 2 CPU devices under jax.distributed, one FSDP mesh over the 4), and a
trainer process SIGKILLed mid-run. Real processes: launcher, gateway, engine, 2 trainers. Run
under the heavy lock.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.smoke_job import (
    REPO,
    assert_no_group_lost,
    child_env,
    jsonl_rows,
    smoke_command,
)

pytestmark = pytest.mark.slow
STEPS, PROMPTS = 4, 4  # configs/smoke.yaml
TWO = ["launch.trainer_processes=2", "launch.trainer_devices=2"]


def _descendants(pid: int) -> list[psutil.Process]:
    """Every live process started (directly or not) by `pid`, or naming the run folder."""
    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if p.is_running()]
    except psutil.NoSuchProcess:
        return []


def _of_run(run_dir: Path) -> list[int]:
    """Live (non-zombie) processes whose command line names `run_dir` (the launcher, the
    gateway, the engines and the trainer processes all do)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(
                str(run_dir) in part for part in p.info["cmdline"] or ()
            ):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _start_long_job(run_dir: Path, tmp_path: Path) -> subprocess.Popen:
    """The smoke job on 2 trainer processes with 1000 steps (stopped by the test)."""
    return subprocess.Popen(
        smoke_command(run_dir, "trainer.steps=1000", *TWO), cwd=REPO, env=child_env(tmp_path),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait_for_steps(job: subprocess.Popen, run_dir: Path, steps: int) -> None:
    """Until metrics.jsonl has `steps` rows (at most 400 s; the job must stay alive)."""
    deadline = time.monotonic() + 400
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= steps):
        assert job.poll() is None, job.stderr.read()[-4000:] if job.stderr else ""
        assert time.monotonic() < deadline, f"no {steps} training steps within 400 s"
        time.sleep(0.5)


@pytest.mark.parametrize(
    ("backend", "data_plane", "bound"),
    [
        ("jax", "gloo", 1e-6),
        ("jax", "jax_transfer", 1e-6),
        pytest.param("vllm", "gloo", 1e-4, marks=pytest.mark.vllm),
    ],
)
def test_two_trainer_processes_complete_the_job_and_serve_its_weights(
    tmp_path, backend, data_plane, bound
):
    """The smoke job on 2 trainer processes (one job per case checks both halves):

    The job: every step's metrics row exactly once (steps and versions 1..4), the loop's
    counts add up (submitted == trained + filtered + in flight, every in-flight group back),
    the engine ends on version 4, the checkpoints of steps 2 and 4 exist (written by both
    processes), both trainer processes exit 0 and nothing of the run is left running.

    The weights: both trainer processes send their own blocks of every version, about half
    each (each process's share of the payload in (0.35, 0.65): process 0's
    ``sync_sent_bytes``, process 1's ``logs/trainer1_sends.jsonl``; the same total every
    version), and the engine serves exactly the trainer's weights: at max_lag 0 with weight
    decay moving the weights every step (as in the single-process data-plane tests), the fp32
    engine's lag-0 sampler_kl stays below `bound` on every step (JAX engine over gloo, and
    over jax_transfer, where the engine pulls each process's blocks onto its own device:
    1e-6; vLLM at TP 2, so each TP rank receives its region from both processes: 1e-4). A
    wrong or misplaced block shows as a gap of the weights' 5% step."""
    run_dir = tmp_path / "run"
    extra = [f"launch.data_plane={data_plane}"]
    extra += ["launch.devices_per_engine=2"] if backend == "vllm" else []
    done = subprocess.run(
        smoke_command(run_dir, f"rollout.backend={backend}", *TWO, *extra, "eval.size=0",
                      "rollout.max_lag=0", "optim.weight_decay=50",
                      "launch.engine_dtype=float32"),
        cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((run_dir / "job_summary.json").read_text())
    loop = summary["loop"]
    metrics = jsonl_rows(run_dir / "metrics.jsonl")
    assert [(r["step"], r["version"]) for r in metrics] == [(s, s) for s in range(1, STEPS + 1)]
    assert all(r["sync_gb_per_s"] > 0 for r in metrics)
    assert (loop["steps"], loop["version"], loop["stop_reason"]) == (STEPS, STEPS, "completed")
    assert summary["trainer_processes"] == 2
    assert list(summary["engine_versions"].values()) == [STEPS]
    assert loop["trained_groups"] == STEPS * PROMPTS
    groups = jsonl_rows(run_dir / "groups.jsonl")
    assert_no_group_lost(loop, summary, groups)
    assert len(groups) == loop["submitted"] - loop["in_flight"]
    # checkpoint_every 2: steps 2 and 4, written by both processes (orbax) with process 0's
    # progress
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [2, 4]
    progress = json.loads((run_dir / "checkpoints" / "4" / "progress" / "metadata").read_text())
    assert (progress["step"], progress["weight_version"]) == (4, STEPS)
    assert summary["exit_codes"] == {
        "gateway": 0, "engine0": 0, "trainer0": 0, "trainer1": 0,
    }  # fmt: skip
    follower_log = (run_dir / "logs" / "trainer1.log").read_text()
    assert f"trainer process 1: {STEPS} steps; process 0 stopped" in follower_log

    lag0 = [r["train/gap/lag0/sampler_kl"] for r in metrics]
    assert all(0 <= x < bound for x in lag0), lag0
    # every push fanned in: each process sent its own blocks, about half each, together the
    # same payload every version (transport.fan_in); process 1's sends of committed pushes
    sends = [r for r in jsonl_rows(run_dir / "logs" / "trainer1_sends.jsonl") if r["ok"]]
    assert [r["version"] for r in sends] == list(range(1, STEPS + 1))
    assert all(r["sync_tp_shards"] == len(extra) for r in metrics)
    totals = {r["sync_sent_bytes"] + s["num_bytes"] for r, s in zip(metrics, sends, strict=True)}
    assert len(totals) == 1 and totals.pop() >= 2 * 213_632  # one fp32 copy of the smoke model
    for r, s in zip(metrics, sends, strict=True):
        assert 0.35 < s["num_bytes"] / (r["sync_sent_bytes"] + s["num_bytes"]) < 0.65, (r, s)
    assert _of_run(run_dir) == []


def test_sigkill_of_trainer_process_1_stops_the_job(tmp_path):
    """SIGKILL trainer process 1 after 2 steps: the job exits non-zero within 60 s, its
    stderr names the lost process ("trainer process 1 ... was lost: killed by SIGKILL"),
    job_summary.json holds the error, every child ended on the launcher's SIGTERM by itself
    (logs/stopped.json: none SIGKILLed after launch.stop_timeout_s; trainer process 0 with
    143 at once, not 130 after the interrupt watcher's grace, though the gateway it calls and
    its peer are gone), and no process of the run
    (gateway, engine, trainer process 0, the launcher) is left."""
    run_dir = tmp_path / "run"
    job = _start_long_job(run_dir, tmp_path)
    try:
        _wait_for_steps(job, run_dir, 2)
        started = _descendants(job.pid)
        victims = [
            p for p in started if "trainer.launch.trainer_worker" in " ".join(p.cmdline())
            and "--process-id 1" in " ".join(p.cmdline())
        ]  # fmt: skip
        assert len(victims) == 1
        assert len(started) >= 4  # gateway, engine, 2 trainer processes
        os.kill(victims[0].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        rc = job.wait(60)
        took = time.monotonic() - killed_at
        err = job.stderr.read() if job.stderr else ""
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
    assert rc != 0 and took < 60, (rc, took)
    print(f"job exited {rc} {took:.1f} s after the SIGKILL of trainer process 1")
    assert re.search(
        rf"trainer process 1 \(pid {victims[0].pid}\) was lost: killed by SIGKILL", err
    ), err[-4000:]
    summary = json.loads((run_dir / "job_summary.json").read_text())
    assert "trainer process 1" in json.dumps(summary)
    # issue 25 item 3: process 0 ended on the launcher's SIGTERM by itself (it was not left
    # retrying the stopped gateway until the launcher's SIGKILL after launch.stop_timeout_s)
    stopped = json.loads((run_dir / "logs" / "stopped.json").read_text())
    assert stopped["sigkilled_after_timeout"] == [], err[-4000:]
    assert stopped["exit_codes"]["trainer0"] == 143, (stopped, err[-4000:])  # not 130: no grace
    assert "SIGTERM from the launcher: this trainer process stops at once" in err
    time.sleep(1.0)
    assert [p.pid for p in started if p.is_running() and p.status() != "zombie"] == []
    assert _of_run(run_dir) == []


def test_save_on_two_processes_resume_on_one_and_on_two(tmp_path):
    """Steps 1-2 on 2 trainer processes (checkpoint 2 written by both), step 3 resumed on 1
    process, step 4 resumed on 2 again from that 1-process checkpoint: each run says where it
    resumed, metrics.jsonl holds steps 1..4 exactly once with versions 1..4, and no problem
    position was consumed twice."""
    run_dir = tmp_path / "run"
    env = child_env(tmp_path)
    for steps, procs, resumed in ((2, 2, None), (3, 1, 2), (4, 2, 3)):
        done = subprocess.run(
            smoke_command(run_dir, f"trainer.steps={steps}", "launch.trainer_devices=2",
                     f"launch.trainer_processes={procs}"),
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        if resumed is not None:
            assert f"resuming from step {resumed} (checkpoint " in done.stderr, done.stderr[-3000:]
        summary = json.loads((run_dir / "job_summary.json").read_text())
        assert (summary["loop"]["steps"], summary["loop"]["version"]) == (steps, steps)
    metrics = jsonl_rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert [r["version"] for r in metrics] == [1, 2, 3, 4]
    groups = jsonl_rows(run_dir / "groups.jsonl")
    positions = [g["position"] for g in groups]
    assert len(positions) == len(set(positions))  # no problem consumed twice
    assert sum(g["outcome"] == "trained" for g in groups) == 4 * PROMPTS
    assert _of_run(run_dir) == []


def test_ctrl_c_stops_two_trainer_processes_gracefully(tmp_path):
    """SIGINT to the launcher after 2 steps: process 0 finishes the update under way, every
    process saves the checkpoint of that step, the job exits 130, summary.json says
    interrupted, both trainer processes exited 0 and nothing of the run is left."""
    run_dir = tmp_path / "run"
    job = _start_long_job(run_dir, tmp_path)
    try:
        _wait_for_steps(job, run_dir, 2)
        started = _descendants(job.pid)
        job.send_signal(signal.SIGINT)
        rc = job.wait(120)
        err = job.stderr.read() if job.stderr else ""
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
    assert rc == 130, err[-4000:]
    loop = json.loads((run_dir / "summary.json").read_text())
    assert loop["stop_reason"].startswith("interrupted"), loop["stop_reason"]
    done = len(jsonl_rows(run_dir / "metrics.jsonl"))
    assert loop["steps"] == done >= 2
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == done
    summary = json.loads((run_dir / "job_summary.json").read_text())
    assert summary["exit_codes"]["trainer0"] == 0 and summary["exit_codes"]["trainer1"] == 0
    time.sleep(1.0)
    assert [p.pid for p in started if p.is_running() and p.status() != "zombie"] == []
    assert _of_run(run_dir) == []
