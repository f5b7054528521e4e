"""Issue 25 item 3: ``sbatch deploy/slurm/rl_job.sbatch`` (its CPU form) under a real Slurm.

slurm-wlm's slurmctld on host ``ctl`` and a slurmd on each of ``n1``..``n4`` of a cluster in
a box (`deploy.local.slurm_box`: its own munge key, each slurmd with its own hostname and
address). The job takes the 4 nodes: the gateway on n1, a JAX engine on n2, the trainer as
2 jax.distributed processes on n3 and n4 (process ids, count and coordinator from srun's
environment). Real processes; run under the heavy lock.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from deploy.local.cluster_box import ClusterBoxError
from deploy.local.slurm_box import SlurmBox, check_slurm
from tests.integration.smoke_job import REPO, child_env, jsonl_rows
from trainer.launch.model_source import resolve_model

pytestmark = pytest.mark.slow
STEPS, PROMPTS = 4, 4  # configs/smoke.yaml
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def test_sbatch_of_the_recipe_runs_the_smoke_job_to_the_end(cluster_box, tmp_path, monkeypatch):
    """The job ends COMPLETED with exit code 0:0 in the controller's job-completion log on
    nodes n[1-4]; the run folder holds steps 1..4 once each at versions 1..4, checkpoints 2
    and 4, every group once; the trainer ran as 2 processes on n3 and n4 (process 1 sent its
    blocks of every version); the gateway listened on n1's address."""
    try:
        check_slurm()
    except ClusterBoxError as err:
        pytest.fail(f"a Slurm in a box cannot run here: {err}")
    monkeypatch.setenv("JAXRL_CACHE_DIR", str(tmp_path / "cache"))
    model = resolve_model("tiny:smollm2")
    box = cluster_box(["ctl", "n1", "n2", "n3", "n4"])
    run = tmp_path / "run"
    env = child_env(tmp_path) | {
        "REPO": str(REPO), "PY": sys.executable, "RUN": str(run), "MODEL": str(model),
        "CONFIG": str(REPO / "configs" / "smoke.yaml"), "ACCEL": "cpu",
        "ENGINE_BACKEND": "jax", "DEVICES": "1", "DTYPE": "float32", "MAX_LEN": "256",
        "EXTRA": "eval.size=0",
    }  # fmt: skip
    with SlurmBox(box, "ctl", ["n1", "n2", "n3", "n4"], tmp_path / "slurm") as slurm:
        job_id = slurm.sbatch(
            REPO / "deploy" / "slurm" / "rl_job.sbatch",
            [f"--output={tmp_path / 'job.out'}"], env, cwd=REPO,
        )  # fmt: skip
        deadline = time.monotonic() + 600
        state = slurm.job_state(job_id)
        while state[0] not in FINAL and time.monotonic() < deadline:
            time.sleep(1)
            state = slurm.job_state(job_id)
        completed = slurm.completed()
    out = (tmp_path / "job.out").read_text(errors="replace")
    trainer_log = _read(run / "logs" / "trainer.log")
    assert state == ("COMPLETED", "0:0"), (state, out[-2000:], trainer_log[-4000:])
    [row] = [r for r in completed if r["JobId"] == str(job_id)]
    assert (row["JobState"], row["ExitCode"], row["NodeList"]) == ("COMPLETED", "0:0", "n[1-4]")

    metrics = jsonl_rows(run / "metrics.jsonl")
    assert [(r["step"], r["version"]) for r in metrics] == [(s, s) for s in range(1, STEPS + 1)]
    result = json.loads((run / "trainer_result.json").read_text())
    assert (result["loop"]["steps"], result["loop"]["stop_reason"]) == (STEPS, "completed")
    assert list(result["engine_versions"].values()) == [STEPS]
    trained = [
        g["sample_id"] for g in jsonl_rows(run / "groups.jsonl") if g["outcome"] == "trained"
    ]
    assert len(trained) == STEPS * PROMPTS and max(Counter(trained).values()) == 1
    checkpoints = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert checkpoints == [2, 4]
    sends = [r for r in jsonl_rows(run / "logs" / "trainer1_sends.jsonl") if r["ok"]]
    assert [r["version"] for r in sends] == list(range(1, STEPS + 1))
    assert f"trainer process 1: {STEPS} steps; process 0 stopped" in trainer_log
    assert f"gateway listening on {box.address('n1')}:50051" in _read(run / "logs" / "gateway.log")
    engines = [e["engine"] for e in jsonl_rows(run / "logs" / "gateway_events.jsonl")
               if e["event"] == "registered"]  # fmt: skip
    assert [e.rsplit("-", 1)[0] for e in engines] == ["engine-n2"]


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"(no {path})"
