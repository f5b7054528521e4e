"""`python -m trainer compare RUN_DIR ... --out PNG`: several runs' reward curves in one plot.

What a researcher draws to set a LoRA run beside the full fine-tune, one engine beside the
other, or two learning rates: per run its trailing moving average of the mean reward per step
(`trainer.launch.plot.plot_series`, the same line as the run's own plot) over its per-step means
(faint), and its held-out accuracy before and after training (`job_summary.json`'s
``eval_before`` / ``eval_after``, or the ``eval/accuracy`` rows of an ``eval.every`` run) as
squares of the run's colour. `compare_runs` returns the figures the plot shows, one dict per run;
the command prints them as a table and one JSON line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.launch.plot import plot_series
from trainer.launch.report import is_eval_row, read_metrics, reward_ends


def _held_out(run_dir: Path, every: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, accuracy) of each held-out evaluation of a run, ascending by step."""
    points = [(int(r["step"]), float(r["eval/accuracy"])) for r in every if "eval/accuracy" in r]
    summary = run_dir / "job_summary.json"
    if summary.exists():
        done = json.loads(summary.read_text())
        steps = done.get("loop", {}).get("steps", 0)
        for key, step in (("eval_before", 0), ("eval_after", steps)):
            entry = done.get(key)
            if isinstance(entry, dict) and entry.get("accuracy") is not None:
                points.append((step, float(entry["accuracy"])))
    return sorted(set(points))


def compare_runs(
    run_dirs: Sequence[str | Path], labels: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Each run's curve and summary figures, in the order given.

    Args:
      run_dirs: run folders, each with a ``metrics.jsonl`` of at least one training row.
      labels: a name per run for the legend (default: each folder's name); as many as runs.

    Returns:
      per run: ``label``, ``run_dir``, ``steps`` (ints), ``reward`` (mean reward per step),
      ``moving`` (its trailing mean over ``window`` steps), ``window``, ``held_out``
      ((step, accuracy) pairs), and `reward_ends`' ``reward_first5`` / ``reward_last5`` /
      ``reward_ends_steps``.

    Raises:
      ValueError: no run, a label count that differs from the run count, or a run without
        training rows (the message names the folder).
    """
    if not run_dirs:
        raise ValueError("compare needs at least one run folder")
    if labels and len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    out = []
    for i, run_dir in enumerate(map(Path, run_dirs)):
        every = read_metrics(run_dir)
        rows = [r for r in every if not is_eval_row(r)]
        if not rows:
            raise ValueError(f"{run_dir / 'metrics.jsonl'} has no training rows to compare")
        s = plot_series(rows)
        out.append(
            {
                "label": labels[i] if labels else run_dir.name,
                "run_dir": str(run_dir),
                "steps": [int(x) for x in s.steps],
                "reward": [float(x) for x in s.reward],
                "moving": [float(x) for x in s.moving],
                "window": s.window,
                "held_out": _held_out(run_dir, every),
                **reward_ends([float(x) for x in s.reward]),
            }
        )
    return out


def plot_comparison(runs: Sequence[dict[str, Any]], out: str | Path, title: str = "") -> Path:
    """Draw `compare_runs`' result into the PNG `out` (its folder made); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, run in enumerate(runs):
        color = f"C{i}"
        ax.plot(run["steps"], run["reward"], lw=0.8, alpha=0.3, color=color)
        ax.plot(run["steps"], run["moving"], lw=2, color=color, label=run["label"])
        if run["held_out"]:
            steps, accuracy = zip(*run["held_out"], strict=True)
            ax.plot(steps, accuracy, ls=":", marker="s", ms=6, color=color)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward / held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    window = max(run["window"] for run in runs)
    ax.set_title(
        title
        or f"mean reward per step (faint), its {window}-step moving average (bold), "
        "held-out accuracy (squares)",
        fontsize="medium",
    )
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_comparison(runs: Sequence[dict[str, Any]]) -> str:
    """A table of the runs: steps, reward of the first and last k steps, held-out accuracy at
    the first and last evaluation."""
    lines = ["run | steps | reward first k -> last k | held-out first -> last"]
    for r in runs:
        held = r["held_out"]
        acc = (
            f"{held[0][1]:.3f} (step {held[0][0]}) -> {held[-1][1]:.3f} (step {held[-1][0]})"
            if held
            else "-"
        )
        lines.append(
            f"{r['label']} | {len(r['steps'])} | {r['reward_first5']:.3f} -> "
            f"{r['reward_last5']:.3f} (k={r['reward_ends_steps']}) | {acc}"
        )
    return "\n".join(lines)
