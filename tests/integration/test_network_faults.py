"""Issue 25 item 4: faults across the network of a cluster in a box, counts asserted exactly.

A cut link here is the switch port of a host set down (`ClusterBox.set_link`): the host keeps
its address and its sockets, nothing reaches it or leaves it, no connection is reset, as when
a cable or a top-of-rack switch fails. Real processes; run under the heavy lock.
"""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest

from tests.integration.cluster_harness import MainJobOnHosts
from tests.integration.smoke_job import jsonl_rows

pytestmark = pytest.mark.slow
PROMPTS = 4  # configs/smoke.yaml


def _wait_rows(job: MainJobOnHosts, rows: int, timeout_s: float) -> None:
    """Until metrics.jsonl has `rows` rows; the trainers must stay alive meanwhile."""
    path = job.run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and len(jsonl_rows(path)) >= rows):
        job.check_alive()
        for name in ("trainer0", "trainer1"):
            if name in job.procs and job.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited early:\n{job.log(name)[-3000:]}")
        assert time.monotonic() < deadline, f"no {rows} steps within {timeout_s} s"
        time.sleep(0.2)


def test_trainer_host_link_down_stops_the_job_and_a_resume_continues_exactly(
    cluster_box, tmp_path
):
    """Trainer process 1's host (node1) loses its link for 20 s after step 3: both trainer
    processes end non-zero within the bounded wait, process 0's log naming the lost process
    (JAX's heartbeat, launch.trainer_heartbeat_timeout_s=10); the link comes back and the job
    is started again on the same hosts (as a requeued Slurm job would be), resumes from the
    last whole checkpoint and trains to step 8: each step once in metrics.jsonl, every
    problem position consumed at most once, the resumed groups of attempt 1, and every
    trained group counted once."""
    steps = 8
    box = cluster_box(["node0", "node1", "node2"])
    job = MainJobOnHosts(
        box, tmp_path / "run", tmp_path, trainer_hosts=["node0", "node1"],
        engine_hosts=["node2"],
        overrides=[f"trainer.steps={steps}", "launch.trainer_devices=1", "eval.size=0",
                   "launch.trainer_heartbeat_timeout_s=10"],
    )  # fmt: skip
    try:
        job.start()
        _wait_rows(job, 3, 400)
        box.set_link("node1", False)
        t_cut = time.monotonic()
        codes = job.wait_trainers(150)
        stopped_after = time.monotonic() - t_cut
        time.sleep(max(0.0, 20 - stopped_after))
        box.set_link("node1", True)
        first = {n: job.log(n) for n in ("trainer0", "trainer1")}
        assert None not in codes and 0 not in codes, (codes, first["trainer0"][-3000:])
        print(f"trainer processes ended {stopped_after:.1f} s after the cut, codes {codes}")
        lost = r"The following tasks are unhealthy \(stopped sending heartbeats\):\s+1\n"
        assert re.search(lost, first["trainer0"]), first["trainer0"][-3000:]
        done = [r["step"] for r in jsonl_rows(job.run_dir / "metrics.jsonl")]
        saved = sorted(
            int(p.name) for p in (job.run_dir / "checkpoints").iterdir() if p.name.isdigit()
        )
        assert saved and saved[-1] <= done[-1] < steps, (saved, done)

        job.stop()  # the serving side too: the whole job starts again
        job.procs.clear()
        job.start()
        assert job.wait_trainers(400) == [0, 0], job.log("trainer0")[-3000:]
    finally:
        job.stop()
    resumed_log = job.log("trainer0")[len(first["trainer0"]) :]
    assert f"resuming from step {saved[-1]}" in resumed_log, resumed_log[-3000:]
    rows = jsonl_rows(job.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # each step once
    assert [r["version"] for r in rows] == list(range(1, steps + 1))
    groups = jsonl_rows(job.run_dir / "groups.jsonl")
    positions = [g["position"] for g in groups]
    assert len(positions) == len(set(positions))  # no problem consumed twice
    trained = [g["sample_id"] for g in groups if g["outcome"] == "trained"]
    assert len(trained) == steps * PROMPTS and max(Counter(trained).values()) == 1
    after = [g for g in groups if g["step"] > saved[-1]]
    assert after and all(g["sample_id"].split(":")[0].endswith("@1") for g in after)
