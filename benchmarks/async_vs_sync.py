"""Async against sync, measured: the real main job at rollout.max_lag 0, 1 and 2.

Each run is ``python -m trainer train --config configs/smoke.yaml`` (the tiny random smoke model,
the JAX engine, P=4 prompts x G=4) with the trainer process (and the gateway) pinned to one
core (``taskset -c TRAINER_CPU``) and the engine to the other (``launch.engine_cpus``), on a
long-tailed length mix: a JSONL task of two-term sums whose rows carry their own budget
(``data.max_new_tokens_field``): one prompt in ten may take 8x the new tokens of the others
(128 against 16; the random model rarely stops early, so nearly every completion runs to its
budget). The long rows sit at every tenth position of the trainer's problem order
(`trainer.data.problem_stream.ProblemStream`, seed trainer.seed), so each run sees the same
mix, the first update included (the trainer compiles both padded lengths during warm-up).

Figures per max_lag, over the updates after `--warmup` (compilation):
- seconds_per_step / steps_per_hour: wall seconds between the metrics rows of update W and N
  (polled every 20 ms) over N - W;
- trainer_idle_fraction: the loop's own ``wait_time_s / total_time_s`` summed over those updates
  (`trainer.loop.AsyncTrainer`: time collecting groups over the update's time);
- engine_idle_fraction: 1 - (the engine process's CPU seconds, utime + stime from
  /proc/PID/stat) / wall seconds over the same window: its one core not in use;
- reward: the job's mean reward over its last 5 updates (``job_summary.json``).
``async_over_sync`` is steps/hour at the best max_lag > 0 over max_lag 0, same script, same run.
``filtered_lag`` (groups dropped for a lag above max_lag) and ``completion_len_mean`` (of the
trained completions) say what the speed costs: a long group that outlives max_lag versions is
dropped, so async trains on fewer long completions. ``sim_inputs`` (at max_lag 0) feed
``benchmarks/async_sim.py --measured``: token_s and overhead_s are the slope and intercept of
each update's wait against its longest completion (`decode_fit`), step_s and sync_s the mean
train-step and push seconds.

Run (the lock every heavy job here takes):
``flock /tmp/jaxrl-heavy.lock .venv/bin/python benchmarks/async_vs_sync.py``.
Prints one line per run and, as the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (/proc/PID/stat fields 14 and
    15, in clock ticks). Raises OSError when the process is gone."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / TICK


def write_task(path: Path, rows: int, short: int, factor: int, every: int, seed: int) -> int:
    """A JSONL task of `rows` two-term sums ("What is a + b?", answer a + b) whose ``budget``
    field is `short`, or `short * factor` for the rows the trainer's problem stream hands out at
    positions 0, every, 2*every, ... (its first epoch). Returns how many rows are long."""
    from trainer.data.problem import Problem
    from trainer.data.problem_stream import ProblemStream

    stream = ProblemStream([Problem(str(i), "", "", "math") for i in range(rows)], seed=seed)
    long_rows = {int(stream.at(p).problem_id) for p in range(0, rows, every)}
    with path.open("w") as f:
        for i in range(rows):
            a, b = i % 10, (7 * i + 3) % 10
            budget = short * factor if i in long_rows else short
            f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": a + b,
                                "budget": budget}) + "\n")  # fmt: skip
    return len(long_rows)


def decode_fit(points: list[tuple[int, float]]) -> dict[str, float]:
    """Least-squares line through (longest completion of an update, tokens; its wait, s):
    ``token_s`` the slope (seconds per decode step) and ``overhead_s`` the intercept (prefill,
    round trips); with a single length, overhead 0 and token_s = mean wait / length.
    (`statistics.linear_regression`, ordinary least squares.)"""
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    if len(set(xs)) < 2:
        return {"token_s": statistics.fmean(ys) / xs[0], "overhead_s": 0.0}
    fit = statistics.linear_regression(xs, ys)
    return {"token_s": fit.slope, "overhead_s": fit.intercept}


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def run_job(
    a: argparse.Namespace, max_lag: int, task: Path, run_dir: Path, extra: tuple[str, ...] = ()
) -> dict:
    """One job at `max_lag` (with `extra` overrides, ``section.key=value``); returns its figures
    (see the module docstring); its log is ``<run_dir>.log``.

    Raises:
        RuntimeError: the job failed or wrote fewer than --steps metrics rows.
    """
    argv = [
        "taskset", "-c", str(a.trainer_cpu), sys.executable, "-m", "trainer", "train",
        "--config", "configs/smoke.yaml", f"run_dir={run_dir}", "launch.progress=false",
        f"launch.engine_cpus={a.engine_cpu}", f"trainer.steps={a.steps}",
        f"rollout.max_lag={max_lag}", "trainer.checkpoint_every=0", "eval.size=0",
        "data.source=jsonl", f"data.path={task}", f"data.size={a.rows}",
        "data.max_new_tokens_field=budget", f"rollout.max_new_tokens={a.short * a.factor}",
        *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    log = run_dir.with_suffix(".log").open("w")
    t_start = time.monotonic()
    job = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    metrics, children = run_dir / "metrics.jsonl", run_dir / "logs" / "children.json"
    marks: dict[int, tuple[float, float, float]] = {}  # rows seen -> (wall, engine cpu, trainer)
    engine_pid = None
    try:
        while job.poll() is None:
            if time.monotonic() - t_start > a.timeout_s:
                raise RuntimeError(f"max_lag {max_lag}: the job ran past {a.timeout_s} s")
            if engine_pid is None and children.exists():
                try:
                    engine_pid = json.loads(children.read_text())["engine0"]["pid"]
                except (ValueError, KeyError):
                    pass
            n = len(_rows(metrics))
            if engine_pid is not None and n in (a.warmup, a.steps) and n not in marks:
                marks[n] = (time.monotonic(), cpu_seconds(engine_pid), cpu_seconds(job.pid))
            time.sleep(0.02)
    finally:
        if job.poll() is None:
            job.terminate()
            job.wait(60)
        log.close()
    rows = _rows(metrics)
    if job.returncode != 0 or len(rows) < a.steps or set(marks) != {a.warmup, a.steps}:
        raise RuntimeError(
            f"max_lag {max_lag}: exit {job.returncode}, {len(rows)}/{a.steps} metrics rows, "
            f"marks at {sorted(marks)}; see {log.name}"
        )
    (t0, e0, c0), (t1, e1, c1) = marks[a.warmup], marks[a.steps]
    window, steps = t1 - t0, a.steps - a.warmup
    after = rows[a.warmup : a.steps]
    summary = json.loads((run_dir / "job_summary.json").read_text())
    groups = _rows(run_dir / "groups.jsonl")
    longest: dict[int, int] = {}
    for g in groups:  # each completion's spans end at its length
        n_max = max(spans[-1][2] for spans in g["version_spans"])
        longest[g["step"]] = max(longest.get(g["step"], 0), n_max)
    return {
        "max_lag": max_lag,
        "seconds_per_step": window / steps,
        "steps_per_hour": 3600.0 * steps / window,
        "trainer_idle_fraction": sum(r["wait_time_s"] for r in after)
        / sum(r["total_time_s"] for r in after),
        "engine_idle_fraction": 1.0 - (e1 - e0) / window,
        "trainer_cpu_busy_fraction": (c1 - c0) / window,
        "reward_first5": summary["reward_first5"],
        "reward_last5": summary["reward_last5"],
        "lag_mean": statistics.fmean(r["lag_mean"] for r in after),
        "filtered_lag": sum(r["filtered_lag"] for r in after),
        "completion_len_mean": statistics.fmean(r["completion_len_mean"] for r in after),
        "step_time_s": statistics.median(r["step_time_s"] for r in after),
        "sync_time_s": statistics.median(r["sync_time_s"] for r in after),
        **decode_fit([(longest[r["step"]], r["wait_time_s"]) for r in after]),
        "step_time_mean_s": statistics.fmean(r["step_time_s"] for r in after),
        "sync_time_mean_s": statistics.fmean(r["sync_time_s"] for r in after),
        "job_wall_s": time.monotonic() - t_start,
    }


def job_args(ap: argparse.ArgumentParser, steps: int) -> None:
    """Add the options of `run_job` and `write_task` to `ap` (`steps`: the default of
    ``--steps``)."""
    ap.add_argument("--steps", type=int, default=steps, help="updates per run (N)")
    ap.add_argument("--warmup", type=int, default=5, help="leading updates left out")
    ap.add_argument("--short", type=int, default=16, help="budget of a short prompt (tokens)")
    ap.add_argument("--factor", type=int, default=8, help="a long prompt's budget / short")
    ap.add_argument("--every", type=int, default=10, help="one long prompt in this many")
    ap.add_argument("--rows", type=int, default=200, help="problems in the task")
    ap.add_argument("--engine-cpu", type=int, default=0)
    ap.add_argument("--trainer-cpu", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=400.0, help="per run")
    ap.add_argument("--keep", type=Path, help="keep the run folders here")


def parse_job_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line; exits with the reason on bad options or without taskset."""
    a = ap.parse_args()
    if not 1 <= a.warmup < a.steps:
        raise SystemExit(f"need 1 <= --warmup < --steps; got {a.warmup}, {a.steps}")
    if shutil.which("taskset") is None:
        raise SystemExit("taskset (util-linux) is needed to pin the processes")
    return a


def main() -> None:
    """Run the job at each max_lag; print a line per run and the JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lags", default="0,1,2")
    job_args(ap, steps=40)
    a = parse_job_args(ap)
    from trainer.launch.job_config import load_job_config

    smoke = load_job_config(REPO / "configs" / "smoke.yaml", []).run
    seed, rows_per_step = (
        smoke.trainer.seed,
        smoke.trainer.prompts_per_step * smoke.rollout.group_size,
    )
    root = Path(a.keep or tempfile.mkdtemp(prefix="async_vs_sync-"))
    root.mkdir(parents=True, exist_ok=True)
    task = root / "sums_mix.jsonl"
    n_long = write_task(task, a.rows, a.short, a.factor, a.every, seed)
    print(f"task: {a.rows} sums, {n_long} with budget {a.short * a.factor} (1 in {a.every}), "
          f"the rest {a.short}; engine on core {a.engine_cpu}, trainer on core "
          f"{a.trainer_cpu}; {a.steps} updates per run, {a.warmup} warm-up")  # fmt: skip
    results = []
    for lag in (int(x) for x in a.lags.split(",")):
        r = run_job(a, lag, task, root / f"lag{lag}")
        results.append(r)
        print(f"max_lag {lag}: {r['seconds_per_step']:.3f} s/step ({r['steps_per_hour']:.0f}/h), "
              f"trainer idle {r['trainer_idle_fraction']:.3f}, engine idle "
              f"{r['engine_idle_fraction']:.3f}, reward last 5 {r['reward_last5']:.3f}, "
              f"lag mean {r['lag_mean']:.2f}, dropped {r['filtered_lag']}, "
              f"job {r['job_wall_s']:.0f} s")  # fmt: skip
    by_lag = {r["max_lag"]: r for r in results}
    keys = {"steps_per_hour": 1, "trainer_idle_fraction": 4, "engine_idle_fraction": 4,
            "seconds_per_step": 4, "reward_last5": 4, "filtered_lag": 0,
            "completion_len_mean": 2}  # fmt: skip
    out: dict = {key: {k: round(r[key], d) for k, r in by_lag.items()} for key, d in keys.items()}
    out |= {"steps": a.steps, "warmup": a.warmup, "runs": results}
    if 0 in by_lag and len(by_lag) > 1:
        best = max((k for k in by_lag if k > 0), key=lambda k: by_lag[k]["steps_per_hour"])
        out["async_over_sync"] = by_lag[best]["steps_per_hour"] / by_lag[0]["steps_per_hour"]
        out["async_best_max_lag"] = best
    ref = by_lag.get(0, results[0])
    out["sim_inputs"] = {"token_s": ref["token_s"], "overhead_s": ref["overhead_s"],
                         "step_s": ref["step_time_mean_s"], "sync_s": ref["sync_time_mean_s"],
                         "rows": rows_per_step}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
