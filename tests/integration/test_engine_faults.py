"""Issue 11, "Elastic engines": the smoke job with two JAX engines and one vLLM engine, one
engine SIGKILLed while it holds leases and another during a push.

`python -m trainer train --config configs/smoke.yaml` runs 20 steps with
``launch.engine_backends=[jax, jax, vllm]``; the test watches the gateway's event log
(``RUN_DIR/logs/gateway_events.jsonl``), its status, and the launcher's
``RUN_DIR/logs/children.json`` (engine pids), and
- SIGKILLs engine0 (JAX) once it holds leased prompts at version >= 3;
- freezes engine2 (vLLM, SIGSTOP) once it loaded version target - 1, and SIGKILLs it when the
  gateway publishes the next version (so it cannot have loaded it: the push re-plans on the
  survivors).
With ``launch.min_engines=2`` the push that loses engine2 waits for the restarted engine0
(up to the publisher's ready timeout) instead of committing on engine1 alone, so the reborn
engine serves the steps that remain however long its restart takes (a restart that took
longer than the rest of the run once left it nothing to lease on CI).
Then checks: all 20 steps complete; no sample id is trained twice; submitted == trained +
filtered + in_flight; engine0's leases went back to the queue within 5 s of its death (the
gateway's `leases_requeued` event against the kill's wall-clock time); the restarted engine0
loaded the gateway's current version before its first lease; the killed vLLM engine never
loaded the version it was killed in, and that version committed on the survivors (a re-plan).
Heavy: run under the shared lock (`flock /tmp/jaxrl-heavy.lock`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gateway.client import GatewayClient
from gateway.events import read_events
from tests.integration.smoke_job import REPO, assert_no_group_lost, child_env, jsonl_rows

STEPS = 20


def kill_while_leased(client: GatewayClient, pgid: int, name: str, min_version: int):
    """SIGKILL the process group `pgid` (the engine named `name`; "" for any) at a moment it
    holds leased prompts at version >= `min_version`; returns (engine id, version) or None.

    A status reply is already old when the kill lands (the engine may have returned its lease
    in between), so the engine is frozen first (SIGSTOP), given 0.3 s for a return already on
    the wire to land, and looked at again: killed if it still holds leases, else thawed.
    """

    def holding(status):
        return [e for e in status.engines
                if (not name or e.name == name) and e.leased_prompts > 0]  # fmt: skip

    status = client.status()
    if status.current_version < min_version or not holding(status):
        return None
    os.killpg(pgid, signal.SIGSTOP)
    time.sleep(0.3)
    status = client.status()
    still = holding(status)
    if not still:
        os.killpg(pgid, signal.SIGCONT)
        return None
    os.killpg(pgid, signal.SIGKILL)
    return still[0].engine_id, int(status.current_version)


class Killer(threading.Thread):
    """Watches the run and kills two engines (see the module docstring); records what it did
    (`kills`: name -> (wall-clock time, pid, engine id, version)) or why it failed (`error`)."""

    def __init__(self, run_dir: Path, job: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.job = run_dir, job
        self.kills: dict[str, tuple[float, int, str, int]] = {}
        self.error: BaseException | None = None

    def _pid(self, name: str) -> int:
        return int(json.loads((self.run_dir / "logs" / "children.json").read_text())[name]["pid"])

    def _events(self) -> list[dict]:
        path = self.run_dir / "logs" / "gateway_events.jsonl"
        return read_events(path) if path.exists() else []

    def _kill(self, name: str, engine_id: str, version: int) -> None:
        pid = self._pid(name)
        os.killpg(pid, signal.SIGKILL)
        self.kills[name] = (time.time(), pid, engine_id, version)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def _run(self) -> None:
        port = self.run_dir / "gateway.port"
        while not port.exists() or not (self.run_dir / "logs" / "children.json").exists():
            if self.job.poll() is not None:
                return
            time.sleep(0.1)
        client = GatewayClient.from_token_file(
            f"127.0.0.1:{int(port.read_text())}", self.run_dir / "tokens.txt", "trainer"
        )
        try:
            while "engine0" not in self.kills:  # engine0 holding leases, a few steps in
                if self.job.poll() is not None:
                    return
                pid = self._pid("engine0")
                hit = kill_while_leased(client, pid, "engine0", 3)
                if hit:
                    self.kills["engine0"] = (time.time(), pid, hit[0], hit[1])
                time.sleep(0.02)
            target = self.kills["engine0"][3] + 3
            vllm = ""
            while not vllm:
                for e in client.status().engines:
                    if e.name == "engine2":
                        vllm = e.engine_id
                time.sleep(0.05)
            # A push of the tiny model loads in ~60 ms, less than a look at the event log and a
            # kill take: freeze the vLLM engine once it loaded version target - 1 (it cannot
            # load the next one), then kill it when the next push begins.
            frozen = False
            while "engine2" not in self.kills:
                if self.job.poll() is not None:
                    if frozen:
                        os.killpg(self._pid("engine2"), signal.SIGCONT)
                    return
                events = self._events()
                if not frozen and any(
                    e["event"] == "loaded" and e["engine"] == vllm and e["version"] >= target - 1
                    for e in events
                ):  # fmt: skip
                    os.killpg(self._pid("engine2"), signal.SIGSTOP)
                    frozen = True
                for e in events if frozen else ():
                    if e["event"] == "published" and not e["replan"] and e["version"] >= target:
                        self._kill("engine2", vllm, int(e["version"]))
                        break
                time.sleep(0.005)
        finally:
            client.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_two_jax_one_vllm_engine_survive_two_kills(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "trainer", "train", "--config", "configs/smoke.yaml",
        f"run_dir={run_dir}", "launch.progress=false", f"trainer.steps={STEPS}",
        "launch.num_engines=3", "launch.engine_backends=[jax, jax, vllm]",
        "launch.engine_dtype=float32", "launch.restart_backoff_s=0.5", "eval.size=0",
        "launch.min_engines=2",
    ]  # fmt: skip
    job = subprocess.Popen(
        command, cwd=REPO, env=child_env(tmp_path), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    killer = Killer(run_dir, job)
    killer.start()
    try:
        _, stderr = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
    killer.join(10)
    assert killer.error is None, killer.error
    assert job.returncode == 0, stderr[-4000:]
    assert set(killer.kills) == {"engine0", "engine2"}, killer.kills

    summary = json.loads((run_dir / "job_summary.json").read_text())
    loop = summary["loop"]
    metrics = jsonl_rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert (loop["steps"], loop["version"]) == (STEPS, STEPS)
    assert_no_group_lost(loop, groups=jsonl_rows(run_dir / "groups.jsonl"))

    events = read_events(run_dir / "logs" / "gateway_events.jsonl")
    by = lambda kind, engine: [e for e in events if e["event"] == kind and e["engine"] == engine]  # noqa: E731

    # engine0: killed holding leases; they went back to the queue within 5 s of its death
    t_kill, _, dead0, _ = killer.kills["engine0"]
    (requeued,) = by("leases_requeued", dead0)
    (dropped,) = by("dropped", dead0)
    assert requeued["prompts"] > 0 and requeued["leases"] >= 1
    # its long poll broke, or the launcher saw the process exit first (it then drops it)
    assert any(x in dropped["reason"] for x in ("long poll was cancelled", "by the trainer"))
    assert requeued["t"] - t_kill < 5.0, (requeued["t"] - t_kill, dropped)
    # the restarted engine0 loaded the current version before its first lease
    assert summary["engine_restarts"]["engine0"] == 1
    later = [
        e for e in events
        if e["event"] == "registered" and e["engine"].startswith("engine0-") and e["t"] > t_kill
    ]  # fmt: skip
    assert len(later) == 1
    reborn = later[0]["engine"]
    leases = by("leased", reborn)
    assert leases, "the restarted engine0 never leased"
    first_lease = leases[0]
    loads = [e for e in by("loaded", reborn) if e["t"] <= first_lease["t"]]
    assert loads and loads[-1]["version"] >= later[0]["current"]
    assert first_lease["weight_version"] >= later[0]["current"]

    # engine2 (vLLM): killed in the push of version v, which committed on the survivors
    _, _, dead2, v = killer.kills["engine2"]
    assert [e["version"] for e in by("loaded", dead2) if e["version"] >= v] == []
    assert [e["engine"] for e in events if e["event"] == "dropped"].count(dead2) == 1
    committed = {e["engine"] for e in events if e["event"] == "loaded" and e["version"] == v}
    assert len(committed) >= 1 and dead2 not in committed
    assert metrics[v - 1]["version"] == v  # the step that pushed it went on


@pytest.mark.slow
@pytest.mark.parametrize(
    ("trainer_processes", "data_plane"), [(1, "gloo"), (2, "gloo"), (2, "jax_transfer")]
)
def test_a_run_whose_only_engine_dies_heals(tmp_path, trainer_processes, data_plane):
    """One JAX engine, SIGKILLed at version >= 3 while it holds leases: its leases go back at
    once, the launcher restarts it, it receives the current version (from the next push, which
    waits for an engine, or from the publisher's catch-up when the trainer was waiting for
    rollouts: no push can come while no engine serves) and leases only after loading it; all
    steps complete. With 2 trainer processes both send every version (fan-in), the catch-up
    included: trainer process 1 logs a committed send of each version the engine loaded. Over
    jax_transfer (each process serves its blocks, the engine pulls) the same holds: the
    restarted engine pulls the catch-up from both processes' servers."""
    run_dir = tmp_path / "run"
    steps = 8
    command = [
        sys.executable, "-m", "trainer", "train", "--config", "configs/smoke.yaml",
        f"run_dir={run_dir}", "launch.progress=false", f"trainer.steps={steps}",
        "launch.restart_backoff_s=0.5", "eval.size=0",
        f"launch.trainer_processes={trainer_processes}", "launch.trainer_devices=1",
        f"launch.data_plane={data_plane}",
    ]  # fmt: skip
    job = subprocess.Popen(
        command, cwd=REPO, env=child_env(tmp_path), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    killed: dict = {}

    def kill_once() -> None:
        port, children = run_dir / "gateway.port", run_dir / "logs" / "children.json"
        while not (port.exists() and children.exists()) and job.poll() is None:
            time.sleep(0.1)
        client = GatewayClient.from_token_file(
            f"127.0.0.1:{int(port.read_text())}", run_dir / "tokens.txt", "trainer"
        )
        try:
            while job.poll() is None and not killed:
                pgid = int(json.loads(children.read_text())["engine0"]["pid"])
                hit = kill_while_leased(client, pgid, "engine0", 3)
                if hit:
                    killed.update(t=time.time(), engine=hit[0], version=hit[1])
                time.sleep(0.02)
        finally:
            client.close()

    watcher = threading.Thread(target=kill_once, daemon=True)
    watcher.start()
    try:
        _, stderr = job.communicate(timeout=400)
    finally:
        if job.poll() is None:
            job.kill()
    watcher.join(10)
    assert job.returncode == 0, stderr[-4000:]
    assert killed, "the engine never held a lease at version >= 3"
    summary = json.loads((run_dir / "job_summary.json").read_text())
    assert summary["loop"]["steps"] == steps and summary["engine_restarts"] == {"engine0": 1}
    events = read_events(run_dir / "logs" / "gateway_events.jsonl")
    requeued = [e for e in events if e["event"] == "leases_requeued"]
    assert [e["engine"] for e in requeued] == [killed["engine"]] and requeued[0]["prompts"] > 0
    reborn = [e for e in events if e["event"] == "registered" and e["t"] > killed["t"]]
    # the trainer may publish one more version from groups it already held while the engine
    # restarts (a push then waits for an engine): the restarted engine meets that one
    assert len(reborn) == 1 and reborn[0]["current"] >= killed["version"]
    mine = [e for e in events if e.get("engine") == reborn[0]["engine"]]
    kinds = [e["event"] for e in mine]
    first_load = kinds.index("loaded")
    assert mine[first_load]["version"] >= reborn[0]["current"]
    assert "leased" not in kinds[:first_load] and "leased" in kinds
    if trainer_processes == 2:
        sends = jsonl_rows(run_dir / "logs" / "trainer1_sends.jsonl")
        committed = {r["version"] for r in sends if r["ok"]}
        loaded = {e["version"] for e in events if e["event"] == "loaded" and e["version"] > 0}
        assert loaded <= committed and set(range(1, steps + 1)) <= committed, (loaded, sends)
