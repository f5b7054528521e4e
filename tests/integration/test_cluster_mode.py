"""Issue 13, cluster mode: the trainer as 2 processes started by hand, each taking its process id,
the count and the coordinator from a Slurm environment (what ``srun`` sets on each task), the
gateway and the JAX engine started on their own as on separate hosts. Real processes on one
machine (the node list is 127.0.0.1); run under the heavy lock.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from models.checkpoints.hf_io import read_hf_config
from models.config import ModelConfig
from tests.integration.smoke_job import REPO, child_env, jsonl_rows
from trainer.launch.job_config import load_job_config
from trainer.launch.model_source import resolve_model
from trainer.launch.processes import ProcessSet
from trainer.launch.stack import start_engines, start_gateway

pytestmark = pytest.mark.slow
STEPS = 4


def _slurm_job_id() -> int:
    """A job id whose coordinator port (JAX's Slurm rule: 61440 + id mod 4096) is free now."""
    for job_id in range(4242, 4242 + 4096, 97):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 61440 + job_id % 4096))
            except OSError:
                continue
        return job_id
    raise OSError("no free port in 61440..65535")


def test_two_trainer_processes_from_a_slurm_environment_run_the_job(tmp_path, monkeypatch):
    """Each worker gets only Slurm's variables (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS
    2, SLURM_PROCID, SLURM_LOCALID), no id, count or coordinator flag; both join, the one
    numbered 0 leads: metrics.jsonl holds steps 1..4 with versions 1..4, the engine serves
    version 4, both processes sent every version (fan-in), and both exit 0."""
    monkeypatch.setenv("JAXRL_CACHE_DIR", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    job = load_job_config(str(REPO / "configs" / "smoke.yaml"),
                          [f"run_dir={run_dir}", "eval.size=0"])  # fmt: skip
    model = resolve_model(job.run.model.path)
    family = ModelConfig.from_hf(read_hf_config(model)).family
    procs = ProcessSet(run_dir / "logs")
    workers: list[subprocess.Popen] = []
    try:
        address = start_gateway(job, procs, run_dir, family)
        token_file = run_dir / "tokens.txt"
        start_engines(job, procs, address, token_file, model, 256)
        job_id = _slurm_job_id()
        for i in range(2):
            env = child_env(tmp_path, PYTHONUNBUFFERED="1", SLURM_JOB_ID=str(job_id),
                            SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS="2",
                            SLURM_PROCID=str(i), SLURM_LOCALID=str(i))  # fmt: skip
            argv = [
                sys.executable, "-m", "trainer.launch.trainer_worker",
                "--config", str(REPO / "configs" / "smoke.yaml"), "--run-dir", str(run_dir),
                "--cluster", "slurm", "--gateway", address, "--token-file", str(token_file),
                "--model", str(model),
            ]  # fmt: skip
            with (tmp_path / f"worker{i}.log").open("w") as out:
                workers.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=out,
                                                stderr=subprocess.STDOUT))  # fmt: skip
        deadline = time.monotonic() + 400
        while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
            procs.check_alive()
            time.sleep(0.5)
        logs = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]
        assert [w.poll() for w in workers] == [0, 0], [x[-3000:] for x in logs]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        procs.stop_all()
    assert "coordinator 127.0.0.1:" not in logs[0]  # no coordinator given: from the env
    metrics = jsonl_rows(run_dir / "metrics.jsonl")
    assert [(r["step"], r["version"]) for r in metrics] == [(s, s) for s in range(1, STEPS + 1)]
    result = json.loads((run_dir / "trainer_result.json").read_text())
    assert list(result["engine_versions"].values()) == [STEPS]
    sends = jsonl_rows(run_dir / "logs" / "trainer1_sends.jsonl")
    assert [r["version"] for r in sends if r["ok"]] == list(range(1, STEPS + 1))
    assert f"trainer process 1: {STEPS} steps; process 0 stopped" in logs[1]
    assert os.path.exists(run_dir / "checkpoints" / str(STEPS))
