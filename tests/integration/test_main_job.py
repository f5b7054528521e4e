"""Issue 7: `python -m trainer train --config configs/smoke.yaml` end to end with each backend
(gateway, one engine process, trainer; vLLM at TP 2 with sharded pushes), and a Ctrl-C that
leaves no process behind.

Checked from the run folder: weight versions advance 1..steps, every engine ends on the last
version, metrics.jsonl (with the train step's sampler KL) and TensorBoard events and the plot
are written, held-out accuracy at versions 0 and `steps` is the mean of the rewards written per
problem, and no rollout is lost: prompts submitted = groups trained + filtered + in flight
at the stop, and every group in flight at the stop came back (fetched and waiting in the
trainer, or taken back by the final evaluation).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.smoke_job import (
    REPO,
    assert_no_group_lost,
    child_env,
    jsonl_rows,
    smoke_command,
)

STEPS, PROMPTS, GROUP, EVAL = 4, 4, 4, 4  # configs/smoke.yaml


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_smoke_job_end_to_end(tmp_path, backend):
    run_dir = tmp_path / "run"
    # vLLM runs at TP 2 (a core per rank) against a trainer FSDP over 2 devices: each push
    # sends every TP rank only its own shard
    tp = ["launch.devices_per_engine=2", "launch.trainer_devices=2", "trainer.fsdp=2"]
    done = subprocess.run(
        smoke_command(run_dir, f"rollout.backend={backend}", *(tp if backend == "vllm" else [])),
        cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "job_summary.json").read_text())
    loop = summary["loop"]

    metrics = jsonl_rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert [r["version"] for r in metrics] == list(range(1, STEPS + 1))
    assert all(r["sync_gb_per_s"] > 0 and r["lag_max"] <= 1 for r in metrics)
    # the k3 estimate of KL(sampler || trainer) is a mean of non-negative terms
    assert all(r["train/sampler_kl"] > -1e-7 for r in metrics)
    assert [r["sync_tp_shards"] for r in metrics] == [2 if backend == "vllm" else 1] * STEPS
    assert (loop["steps"], loop["version"]) == (STEPS, STEPS)
    assert summary["backend"] == backend
    assert list(summary["engine_versions"].values()) == [STEPS]  # one engine, on the last

    # no rollout lost
    assert loop["trained_groups"] == STEPS * PROMPTS
    groups = jsonl_rows(run_dir / "groups.jsonl")
    assert_no_group_lost(loop, summary, groups)
    assert len(groups) == loop["submitted"] - loop["in_flight"]
    assert metrics[-1]["submitted"] == loop["submitted"]

    for tag, version in (("before", 0), ("after", STEPS)):
        result = summary[f"eval_{tag}"]
        assert (result["version"], result["problems"], result["samples"]) == (version, EVAL, 1)
        rows = jsonl_rows(run_dir / f"eval_{tag}.jsonl")
        assert len(rows) == EVAL and all(len(r["rewards"]) == 1 for r in rows)  # one sample each
        # the reported accuracy is the mean of the rewards written per problem
        rewards = [x for r in rows for x in r["rewards"]]
        assert result["accuracy"] == pytest.approx(sum(rewards) / EVAL, abs=1e-12)
    assert Path(summary["plot"]).read_bytes()[:4] == b"\x89PNG"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert summary["exit_codes"] == {"gateway": 0, "engine0": 0}

    # the run folder: checkpoints at steps 2 and 4, only the newest with optimizer state (the
    # older one is its params alone: about a third of a checkpoint with Adam's two moments)
    ckpt = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["2", "4"]
    assert [(ckpt / s / "opt_state").is_dir() for s in ("2", "4")] == [False, True]
    sizes = {s: _bytes(ckpt / s) for s in ("2", "4")}
    assert sizes["4"] - sizes["2"] > 0.9 * _bytes(ckpt / "4" / "opt_state"), sizes
    # a 4-step run's closing lines compare 2 steps with 2, not 5 with 5
    assert "mean reward: first 2 steps " in done.stdout
    # orbax and absl notes are in the run's log, not on the terminal
    assert "orbax" not in done.stderr and (run_dir / "logs" / "trainer.log").is_file()


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _sessions_of(run_dir: Path) -> set[int]:
    """Session ids of the session leaders whose command line names `run_dir` (the gateway and
    the engines; the launcher names it too but runs in the test's session)."""
    out = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if str(run_dir) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                sid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3])
                if sid == int(proc.name):
                    out.add(sid)
        except OSError:
            continue
    return out


def _alive_in(sessions: set[int]) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in sessions and fields[0] != "Z":
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
def test_ctrl_c_stops_every_process(tmp_path):
    run_dir = tmp_path / "run"
    job = subprocess.Popen(
        smoke_command(run_dir, "trainer.steps=1000"), cwd=REPO, env=child_env(tmp_path),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert job.poll() is None, job.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no training step within 240 s"
            time.sleep(0.5)
        sessions = _sessions_of(run_dir)
        assert len(sessions) == 2  # the gateway and the engine, each in its own session
        job.send_signal(signal.SIGINT)
        assert job.wait(60) == 130
    finally:
        if job.poll() is None:
            job.kill()
    time.sleep(0.5)
    assert _alive_in(sessions) == []


@pytest.mark.slow
def test_trainer_joins_a_gateway_started_elsewhere(tmp_path):
    """The separate-hosts recipe (docs/clusters.md) on one machine: gateway and engine by hand,
    the trainer joins with launch.gateway and starts no process of its own; with
    launch.stop_joined=true it shuts the gateway (and so its engine) down at the end."""
    from models.checkpoints.tiny import make_tiny_checkpoint
    from trainer.launch.processes import ProcessSet

    env = child_env(tmp_path)
    model = make_tiny_checkpoint(tmp_path / "model", "smollm2", seed=0)
    tokens = tmp_path / "tokens.txt"
    port_file = tmp_path / "port"
    py = sys.executable
    with ProcessSet(tmp_path / "logs", timeout_s=20) as procs:
        subprocess.run([py, "-m", "gateway", "make-tokens", str(tokens)], check=True, env=env)
        procs.start("gateway", [py, "-m", "gateway", "serve", "--token-file", str(tokens),
                                "--port-file", str(port_file)], env)  # fmt: skip
        deadline = time.monotonic() + 30
        while not port_file.exists():
            procs.check_alive()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        gw = f"127.0.0.1:{port_file.read_text()}"
        procs.start("engine", [
            py, "-m", "rollout_engine", "--backend", "jax", "--gateway", gw, "--token-file",
            str(tokens), "--model", str(model), "--dtype", "float32", "--transports", "gloo",
            "--jax-num-slots", "32", "--jax-max-model-len", "128", "--jax-steps-per-call", "8",
        ], env)  # fmt: skip
        run_dir = tmp_path / "run"
        done = subprocess.run(
            smoke_command(run_dir, f"launch.gateway={gw}", f"launch.token_file={tokens}",
                     "trainer.steps=2", "eval.size=0", "launch.stop_joined=true"),
            cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads((run_dir / "job_summary.json").read_text())
        assert summary["exit_codes"] == {}  # it started nothing
        assert list(summary["engine_versions"].values()) == [2]
        loop = summary["loop"]
        back = summary["in_flight_waiting_in_trainer"] + summary["in_flight_drained_after_stop"]
        assert back == loop["in_flight"]
        assert summary["eval_before"] is None and summary["eval_after"] is None
        # asked to (launch.stop_joined), the trainer's shutdown ended the gateway and its engine;
        # by default a joined gateway keeps running (tests/integration/test_job_stops.py)
        assert procs.wait_all(30)


@pytest.mark.slow
def test_rerun_resumes_from_the_checkpoint(tmp_path):
    """A second run in the same folder restores step 2, pushes version 2 to its fresh engine
    and trains steps 3..4 on the same metrics.jsonl."""
    run_dir = tmp_path / "run"
    for steps in (2, 4):
        done = subprocess.run(
            smoke_command(run_dir, f"trainer.steps={steps}", "eval.size=0"),
            cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    metrics = jsonl_rows(run_dir / "metrics.jsonl")
    assert [(r["step"], r["version"]) for r in metrics] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    summary = json.loads((run_dir / "job_summary.json").read_text())
    assert (summary["loop"]["steps"], summary["loop"]["version"]) == (4, 4)
    assert list(summary["engine_versions"].values()) == [4]


@pytest.mark.slow
def test_smoke_job_over_the_shm_data_plane(tmp_path):
    """launch.data_plane=shm: every version reaches the JAX engine through a shared-memory
    segment in a fresh /dev/shm folder, exactly (at max_lag 0 the fp32 engine's lag-0
    sampler_kl stays below 1e-6 while weight decay moves the weights every step, as in the
    file-delta test below), and the run leaves nothing in /dev/shm."""
    shm = Path("/dev/shm")
    before = {p.name for p in shm.glob("jaxrl-*")}
    run_dir = tmp_path / "run"
    done = subprocess.run(
        smoke_command(run_dir, "rollout.backend=jax", "eval.size=0", "rollout.max_lag=0",
                      "optim.weight_decay=50", "launch.data_plane=shm"),
        cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = jsonl_rows(run_dir / "metrics.jsonl")
    assert [(r["step"], r["version"]) for r in metrics] == [(s, s) for s in range(1, STEPS + 1)]
    lag0 = [r["train/gap/lag0/sampler_kl"] for r in metrics]
    assert all(0 <= x < 1e-6 for x in lag0), lag0
    assert {p.name for p in shm.glob("jaxrl-*")} == before  # segments and folder unlinked
    summary = json.loads((run_dir / "job_summary.json").read_text())
    assert list(summary["engine_versions"].values()) == [STEPS]


@pytest.mark.slow
def test_smoke_job_over_the_file_data_plane_with_deltas(tmp_path):
    """launch.data_plane=file with file_delta: versions 1 and 3 are keyframes, 2 and 4 deltas
    (file_full_every=2), and the engine holds the trainer's weights exactly at each version:
    at max_lag 0 every step from 2 on trains on tokens the fp32 JAX engine sampled with
    weights that came through the deltas, and their sampler_kl stays below 1e-6 while the
    weights move every step (the tiny model's rewards are mostly 0, so weight decay moves
    them: 5% a step at lr 1e-3; a stale or wrong rebuild shows as a gap of that size)."""
    run_dir = tmp_path / "run"
    done = subprocess.run(
        smoke_command(run_dir, "rollout.backend=jax", "eval.size=0", "rollout.max_lag=0",
                      "optim.weight_decay=50", "launch.data_plane=file", "launch.file_delta=true",
                      "launch.file_full_every=2"),
        cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = jsonl_rows(run_dir / "metrics.jsonl")
    assert [(r["step"], r["version"]) for r in metrics] == [(s, s) for s in range(1, STEPS + 1)]
    lag0 = [r["train/gap/lag0/sampler_kl"] for r in metrics]  # every token is lag 0
    assert all(0 <= x < 1e-6 for x in lag0), lag0
    kept = {int(p.name[1:]): p for p in (run_dir / "weights").iterdir() if p.name[:1] == "v"}
    assert sorted(kept) == [3, 4]  # keep 2: the newest two, and v4's keyframe is v3
    chains = {v: json.loads((p / "chain.json").read_text()) for v, p in kept.items()}
    assert [(chains[v]["base"], chains[v]["keyframe"]) for v in (3, 4)] == [(None, 3), (3, 3)]
    assert chains[3]["sha256"] != chains[4]["sha256"]  # the step moved the weights
    summary = json.loads((run_dir / "job_summary.json").read_text())
    assert list(summary["engine_versions"].values()) == [STEPS]
