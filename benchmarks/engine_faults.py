"""Seconds from an engine's SIGKILL to its leases being leased again, and the steps per minute
of a smoke run while one engine is killed every `--kill-every` seconds, against the same run
with no kills (the ratio).

Each run is the main job (`python -m trainer train --config configs/smoke.yaml`, tiny random
model, `--engines` JAX engines, no evaluation, `--steps` steps, the launcher's supervisor
restarting the dead engines). This process watches the run folder: it SIGKILLs one engine's
process group (engine0, engine1, ... in turn) every `--kill-every` seconds once training began,
at the first moment after that when the engine holds leased prompts (the gateway's status),
and reads the gateway's event log (``RUN_DIR/logs/gateway_events.jsonl``) afterwards:
- `kill_to_requeued_s`: wall-clock seconds from the SIGKILL to the gateway's
  `leases_requeued` event of that engine (the gateway drops it when its long poll breaks);
- `kill_to_leased_again_s`: to the first `leased` event of another engine after that (the
  requeued prompts are at the front of the queue, so that lease takes them);
both as the median over the kills of the faulty run whose engine held leases when it died.
Steps per minute: (steps - 1) / (seconds between the first and the last metrics row) * 60,
the rows' arrival times seen by polling `metrics.jsonl` every 0.05 s. The reference is the
same job without kills, measured in the same invocation (first); `ratio` = faulty / clean.

Usage: python benchmarks/engine_faults.py [--steps 240] [--engines 2] [--kill-every 30]
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway.client import GatewayClient
from gateway.errors import GatewayError

REPO = Path(__file__).resolve().parents[1]


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "gateway_events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _kill_holding(run_dir: Path, client: GatewayClient, args, kills: list) -> bool:
    """SIGKILL the next engine in turn once it holds leased prompts (checked on the gateway's
    status); True when it was killed. An engine still restarting is skipped."""
    name = f"engine{len(kills) % args.engines}"
    children = json.loads((run_dir / "logs" / "children.json").read_text())
    if children[name]["status"] is not None:
        kills.append((float("nan"), name))  # dead already (restarting): the next one's turn
        return False
    try:
        engines = client.status().engines
    except GatewayError:  # the job is ending: its gateway shut down
        return False
    if not any(e.name == name and e.leased_prompts > 0 for e in engines):
        return False
    os.killpg(int(children[name]["pid"]), signal.SIGKILL)
    kills.append((time.time(), name))
    return True


def run_job(tmp: Path, tag: str, args: argparse.Namespace, kill_every: float | None) -> dict:
    """One smoke run; returns its steps/min and, with kills, the kill -> requeue figures.

    Raises:
      RuntimeError: the job failed (its stderr's tail inside).
    """
    run_dir = tmp / tag
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"JAXRL_CACHE_DIR": str(tmp / "cache"), "JAX_PLATFORMS": "cpu"}
    command = [
        sys.executable, "-m", "trainer", "train", "--config", "configs/smoke.yaml",
        f"run_dir={run_dir}", "launch.progress=false", f"trainer.steps={args.steps}",
        f"launch.num_engines={args.engines}", "eval.size=0", "launch.restart_backoff_s=0.5",
        "launch.max_restarts=100",
    ]  # fmt: skip
    job = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    metrics = run_dir / "metrics.jsonl"
    arrivals: list[float] = []
    kills: list[tuple[float, str]] = []  # (wall time, engine name)
    next_kill = None
    client = None
    try:
        while job.poll() is None:
            n = metrics.read_text().count("\n") if metrics.exists() else 0
            arrivals += [time.time()] * (n - len(arrivals))
            if kill_every and arrivals:
                if client is None:
                    address = f"127.0.0.1:{int((run_dir / 'gateway.port').read_text())}"
                    client = GatewayClient.from_token_file(
                        address, run_dir / "tokens.txt", "trainer"
                    )
                next_kill = next_kill or arrivals[0] + kill_every
                if time.time() >= next_kill and _kill_holding(run_dir, client, args, kills):
                    next_kill += kill_every
            time.sleep(0.02)
    finally:
        if client is not None:
            client.close()
        if job.poll() is None:
            job.kill()
    stderr = job.stderr.read() if job.stderr else ""
    if job.returncode != 0:
        raise RuntimeError(
            f"{tag} run failed ({job.returncode}), run folder {run_dir}: {stderr[-3000:]}"
        )
    n = metrics.read_text().count("\n")
    arrivals += [time.time()] * (n - len(arrivals))
    steps_per_min = (len(arrivals) - 1) / max(arrivals[-1] - arrivals[0], 1e-9) * 60
    kills = [k for k in kills if k[0] == k[0]]  # the real kills (NaN: a skipped turn)
    out: dict = {"steps": len(arrivals), "steps_per_min": steps_per_min, "kills": len(kills)}
    if kills:
        events = _events(run_dir)
        requeue, again = [], []
        for t_kill, name in kills:
            drops = [
                e for e in events
                if e["event"] == "leases_requeued" and e["engine"].startswith(f"{name}-")
                and e["t"] >= t_kill - 1.0
            ]  # fmt: skip
            if not drops or drops[0]["prompts"] == 0:
                continue  # it held no lease when it died
            d = drops[0]
            requeue.append(d["t"] - t_kill)
            nxt = [
                e for e in events
                if e["event"] == "leased" and e["t"] >= d["t"] and e["engine"] != d["engine"]
            ]  # fmt: skip
            if nxt:
                again.append(nxt[0]["t"] - t_kill)
        out["kills_holding_leases"] = len(requeue)
        out["kill_to_requeued_s"] = statistics.median(requeue) if requeue else None
        out["kill_to_leased_again_s"] = statistics.median(again) if again else None
        out["restarts"] = sum(e["event"] == "registered" for e in events) - args.engines
    return out


def main() -> None:
    """Run the clean and the faulty job; print each, then the summary JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--kill-every", type=float, default=30.0)
    args = p.parse_args()
    if args.steps < 2 or args.engines < 2 or args.kill_every <= 0:
        p.error("--steps >= 2, --engines >= 2 (one must survive each kill), --kill-every > 0")
    tmp = tempfile.mkdtemp(prefix="engine_faults-")  # kept when a run fails, for its logs
    clean = run_job(Path(tmp), "clean", args, None)
    print("clean:", json.dumps(clean), flush=True)
    faulty = run_job(Path(tmp), "faulty", args, args.kill_every)
    print("faulty:", json.dumps(faulty), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    summary = {
        "kill_to_requeued_s": faulty.get("kill_to_requeued_s"),
        "kill_to_leased_again_s": faulty.get("kill_to_leased_again_s"),
        "kills": faulty["kills"],
        "kills_holding_leases": faulty.get("kills_holding_leases", 0),
        "restarts": faulty.get("restarts", 0),
        "steps": args.steps,
        "engines": args.engines,
        "kill_every_s": args.kill_every,
        "steps_per_min_with_kills": faulty["steps_per_min"],
        "steps_per_min_clean": clean["steps_per_min"],
        "ratio": faulty["steps_per_min"] / clean["steps_per_min"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
