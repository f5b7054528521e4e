"""Issue 25, "Many hosts for real", on loopback: the smoke job with its one JAX engine
survives (1) that engine SIGKILLed right after the gateway publishes a version, at several
delays into the push (before the send, during it, after the commit), and (2) that engine
frozen (SIGSTOP) for longer than the gateway's heartbeat timeout, then thawed (SIGCONT), as
a host cut off by a link outage comes back.

(1) Each kill lands 0, 0.1 or 0.2 s after a `published` event; the launcher restarts the
engine, and the push waits for it whether the engine died before or after the data plane
committed, re-planning the version on the restarted engine (which meets the dead group's plan
first and fails it: that ack is ignored, never counted against the re-plan).
(2) The gateway drops the frozen engine (missed heartbeats) and puts its leases back; thawed,
the same process registers again (no restart), loads the current version before any lease,
and serves.
Either way all steps complete, no sample id is trained twice, and submitted == trained +
filtered + in_flight. Heavy: run under the shared lock (`flock /tmp/jaxrl-heavy.lock`).
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

DELAYS = (0.0, 0.1, 0.2)


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "gateway_events.jsonl"
    return read_events(path) if path.exists() else []


def _pid(run_dir: Path) -> int:
    return int(json.loads((run_dir / "logs" / "children.json").read_text())["engine0"]["pid"])


def _run(run_dir: Path, tmp_path: Path, steps: int, act, *overrides: str):
    """Run the smoke job with one JAX engine while `act(job)` runs in a thread; returns
    (the job's stderr, what `act` returned)."""
    command = [
        sys.executable, "-m", "trainer", "train", "--config", "configs/smoke.yaml",
        f"run_dir={run_dir}", "launch.progress=false", f"trainer.steps={steps}",
        "launch.restart_backoff_s=0.5", "eval.size=0", *overrides,
    ]  # fmt: skip
    job = subprocess.Popen(
        command, cwd=REPO, env=child_env(tmp_path), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out: dict = {}

    def go() -> None:
        try:
            out["result"] = act(job)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    watcher = threading.Thread(target=go, daemon=True)
    watcher.start()
    try:
        _, stderr = job.communicate(timeout=900)
    finally:
        if job.poll() is None:
            job.kill()
    watcher.join(30)
    assert "error" not in out, out["error"]
    assert job.returncode == 0, stderr[-4000:]
    return stderr, out.get("result")


def _check_accounting(run_dir: Path, steps: int) -> dict:
    summary = json.loads((run_dir / "job_summary.json").read_text())
    loop = summary["loop"]
    metrics = jsonl_rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    assert (loop["steps"], loop["version"]) == (steps, steps)
    assert_no_group_lost(loop, groups=jsonl_rows(run_dir / "groups.jsonl"))
    return summary


def _loaded_before_leasing(events: list[dict], engine: str, current: int) -> None:
    """`engine` held the gateway's version at its registration (`current`) before its first
    lease: it loaded it, or registered holding it (a frozen engine whose load of that
    version finished when it was thawed, before it registered again)."""
    mine = [e for e in events if e.get("engine") == engine]
    kinds = [e["event"] for e in mine]
    assert "leased" in kinds, f"{engine} never leased"
    first_lease = kinds.index("leased")
    assert kinds[0] == "registered", (engine, kinds)
    held = [mine[0]["weight_version"]]
    held += [e["version"] for e in mine[:first_lease] if e["event"] == "loaded"]
    assert held[-1] >= current, (engine, kinds, held)


@pytest.mark.slow
def test_the_only_engine_killed_right_after_a_publish_is_waited_for(tmp_path):
    run_dir, steps = tmp_path / "run", 10

    def kill_after_publishes(job: subprocess.Popen) -> list[tuple[float, str, int]]:
        kills: list[tuple[float, str, int]] = []  # (delay, engine id, version)
        while not (run_dir / "logs" / "children.json").exists():
            if job.poll() is not None:
                return kills
            time.sleep(0.1)
        seen = 0
        for delay in DELAYS:
            while True:  # a first publication above the last kill's, to a serving engine
                if job.poll() is not None:
                    return kills
                events = _events(run_dir)
                new, seen = events[seen:], len(events)
                last = kills[-1][2] if kills else 1
                hit = [e for e in new if e["event"] == "published" and not e["replan"]
                       and e["version"] > last and e["engines"]]  # fmt: skip
                if hit:
                    break
                time.sleep(0.002)
            time.sleep(delay)
            (engine,) = hit[0]["engines"]
            os.killpg(_pid(run_dir), signal.SIGKILL)
            kills.append((delay, engine, int(hit[0]["version"])))
            while not any(  # the restarted engine loaded a version: the next kill may come
                e["event"] == "loaded" and e["engine"] not in [k[1] for k in kills]
                for e in _events(run_dir)[seen:]
            ):  # fmt: skip
                if job.poll() is not None:
                    return kills
                time.sleep(0.05)
        return kills

    stderr, kills = _run(run_dir, tmp_path, steps, kill_after_publishes)
    assert [k[0] for k in kills] == list(DELAYS), (kills, stderr[-3000:])
    summary = _check_accounting(run_dir, steps)
    assert summary["engine_restarts"] == {"engine0": len(DELAYS)}
    events = _events(run_dir)
    reborn = [e for e in events if e["event"] == "registered"][1:]
    assert len(reborn) == len(DELAYS)
    for r in reborn:
        _loaded_before_leasing(events, r["engine"], r["current"])
    # a restarted engine may fail the dead group's plan before the re-plan: it loads the re-plan
    for failed in [e for e in events if e["event"] == "sync_failed"]:
        later = [e for e in events if e["t"] >= failed["t"] and e.get("engine") == failed["engine"]]
        assert any(e["event"] == "loaded" and e["version"] >= failed["version"] for e in later)


@pytest.mark.slow
def test_an_engine_frozen_past_the_heartbeat_timeout_rejoins(tmp_path):
    run_dir, steps = tmp_path / "run", 8

    def freeze_while_leased(job: subprocess.Popen) -> dict:
        while not (run_dir / "logs" / "children.json").exists():
            if job.poll() is not None:
                return {}
            time.sleep(0.1)
        while True:  # engine0 holding leased prompts, a version or two in
            if job.poll() is not None:
                return {}
            events = _events(run_dir)
            published = [e["version"] for e in events if e["event"] == "published"]
            if published and max(published) >= 2:
                break
            time.sleep(0.05)
        client = GatewayClient.from_token_file(
            f"127.0.0.1:{int((run_dir / 'gateway.port').read_text())}",
            run_dir / "tokens.txt", "trainer",
        )  # fmt: skip
        try:  # freeze it, look again (a return may have been on the wire), thaw if it holds none
            pid = _pid(run_dir)
            while True:
                if job.poll() is not None:
                    return {}
                holding = [e for e in client.status().engines if e.leased_prompts > 0]
                if holding:
                    os.killpg(pid, signal.SIGSTOP)
                    time.sleep(0.3)
                    holding = [e for e in client.status().engines if e.leased_prompts > 0]
                    if holding:
                        break
                    os.killpg(pid, signal.SIGCONT)
                time.sleep(0.02)
        finally:
            client.close()
        engine = holding[0].engine_id
        frozen_at = time.time()
        try:
            while not any(
                e["event"] == "dropped" and e["engine"] == engine for e in _events(run_dir)
            ):  # fmt: skip
                if job.poll() is not None:
                    return {}
                time.sleep(0.1)
            time.sleep(1.0)
        finally:
            os.killpg(pid, signal.SIGCONT)
        return {"engine": engine, "pid": pid, "t": frozen_at}

    _, frozen = _run(
        run_dir, tmp_path, steps, freeze_while_leased,
        "launch.engine_heartbeat_timeout_s=5", "launch.engine_rejoin_s=120",
    )  # fmt: skip
    assert frozen, "the engine was never frozen"
    summary = _check_accounting(run_dir, steps)
    assert summary["engine_restarts"] in ({}, {"engine0": 0})  # the same process came back
    assert _pid(run_dir) == frozen["pid"]
    events = _events(run_dir)
    (dropped,) = [e for e in events if e["event"] == "dropped"]
    assert dropped["engine"] == frozen["engine"] and "missed heartbeats" in dropped["reason"]
    (requeued,) = [e for e in events if e["event"] == "leases_requeued"]
    assert requeued["engine"] == frozen["engine"] and requeued["prompts"] > 0
    registered = [e for e in events if e["event"] == "registered"]
    assert len(registered) == 2 and registered[1]["t"] > dropped["t"]
    _loaded_before_leasing(events, registered[1]["engine"], registered[1]["current"])
