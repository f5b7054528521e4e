"""The run's plot, ``RUN_DIR/reward_lag.png``: what a researcher reads first.

Top panel (three quarters of the height): the mean reward per step with a band of ±1
standard error of that mean (the step's reward std / sqrt(completions)), clipped to the
rewards the step actually held (so a 0/1 reward's band stays within [0, 1]); a trailing
moving average; held-out accuracy at every evaluation (the before/after ones too, without
``eval.every``). Bottom panel (a quarter): mean and max lag in versions (with tool calls per
episode in a multi-turn run), its legend above the axes, never over the points.

`plot_series` computes every drawn line (tested on its values); `plot_metrics` draws them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

PLOT_NAME = "reward_lag.png"
MOVING_AVERAGE_STEPS = 5


@dataclasses.dataclass
class PlotSeries:
    """What the plot draws, one value per training step (arrays of length n, float64) unless
    said otherwise.

    Attributes:
      steps: the step numbers.
      reward: the mean reward.
      band_low, band_high: mean ∓ one standard error, clipped to [reward_min, reward_max] of
        the step (rows without them: the mean ± std, clipped to the run's range of means).
      moving: the trailing mean of `reward` over `window` steps (fewer at the start).
      window: the moving average's width in steps.
      held_out: (step, accuracy) of every held-out evaluation, ascending by step.
      lag_mean, lag_max: versions between the sampling and the trained weights.
      tool_calls: tool calls per episode (NaN where absent), or None in a single-turn run.
    """

    steps: np.ndarray
    reward: np.ndarray
    band_low: np.ndarray
    band_high: np.ndarray
    moving: np.ndarray
    window: int
    held_out: list[tuple[int, float]]
    lag_mean: np.ndarray
    lag_max: np.ndarray
    tool_calls: np.ndarray | None


def plot_series(
    rows: Sequence[dict[str, Any]], held_out: Sequence[tuple[int, float]] = ()
) -> PlotSeries:
    """The plot's lines from the training rows of metrics.jsonl (`rows`, ascending steps) and
    held-out accuracies (`held_out`: (step, accuracy) pairs, merged with the rows' ``eval/*``
    ones by the caller).

    Raises:
      ValueError: no rows.
    """
    if not rows:
        raise ValueError("no training rows to plot")
    steps = np.array([r["step"] for r in rows])
    reward = np.array([r["reward_mean"] for r in rows], np.float64)
    std = np.array([r.get("reward_std", 0.0) for r in rows], np.float64)
    count = np.array([r.get("reward_count", 1.0) for r in rows], np.float64)
    sem = std / np.sqrt(np.maximum(count, 1.0))
    low = np.array([r.get("reward_min", np.nan) for r in rows], np.float64)
    high = np.array([r.get("reward_max", np.nan) for r in rows], np.float64)
    low = np.where(np.isnan(low), reward.min(), low)
    high = np.where(np.isnan(high), reward.max(), high)
    window = min(MOVING_AVERAGE_STEPS, len(rows))
    sums = np.cumsum(np.concatenate([[0.0], reward]))
    first = np.maximum(np.arange(len(rows)) + 1 - window, 0)
    moving = (sums[1:] - sums[first]) / (np.arange(len(rows)) + 1 - first)
    multi_turn = any("tool_calls_per_episode" in r for r in rows)
    return PlotSeries(
        steps=steps,
        reward=reward,
        band_low=np.clip(reward - sem, low, high),
        band_high=np.clip(reward + sem, low, high),
        moving=moving,
        window=window,
        held_out=sorted((int(s), float(a)) for s, a in held_out),
        lag_mean=np.array([r["lag_mean"] for r in rows], np.float64),
        lag_max=np.array([r["lag_max"] for r in rows], np.float64),
        tool_calls=np.array([r.get("tool_calls_per_episode", np.nan) for r in rows])
        if multi_turn
        else None,
    )


def plot_metrics(run_dir: str | Path, held_out: Sequence[tuple[int, float]] = ()) -> Path:
    """Draw ``run_dir/metrics.jsonl`` (and the (step, accuracy) pairs of `held_out`, e.g. the
    before/after evaluations of a run without ``eval.every``) into ``run_dir/reward_lag.png``
    (see the module docstring); returns its path.

    Raises:
      ValueError: metrics.jsonl has no training rows.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.launch.report import is_eval_row, read_metrics

    every = read_metrics(run_dir)
    rows = [r for r in every if not is_eval_row(r)]
    if not rows:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'} has no training rows to plot")
    evals = [(r["step"], r["eval/accuracy"]) for r in every if "eval/accuracy" in r]
    s = plot_series(rows, [*evals, *held_out])
    fig, (ax_r, ax_l) = plt.subplots(
        2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    ax_r.plot(s.steps, s.reward, marker="o", ms=3, lw=1, alpha=0.6, label="mean reward")
    ax_r.fill_between(s.steps, s.band_low, s.band_high, alpha=0.2, label="±1 standard error")
    ax_r.plot(s.steps, s.moving, lw=2, color="tab:blue",
              label=f"moving average ({s.window} steps)")  # fmt: skip
    if s.held_out:
        ax_r.plot([p[0] for p in s.held_out], [p[1] for p in s.held_out], marker="s", ms=5,
                  color="tab:red", label="held-out accuracy")  # fmt: skip
        for step, acc in (s.held_out[0], s.held_out[-1]):
            ax_r.annotate(f"{acc:.2f}", (step, acc), textcoords="offset points", xytext=(0, 6),
                          ha="center", color="tab:red", fontsize="small")  # fmt: skip
    ax_r.set_ylabel("reward")
    ax_r.legend(loc="best", fontsize="small")
    ax_r.grid(alpha=0.3)
    ax_l.plot(s.steps, s.lag_mean, lw=1, label="mean lag")
    ax_l.plot(s.steps, s.lag_max, ls="--", lw=1, label="max lag")
    ax_l.set_ylim(-0.1, max(1.0, float(s.lag_max.max())) * 1.2 + 0.1)
    ax_l.set_ylabel("lag")
    ax_l.set_xlabel("step")
    handles, labels = ax_l.get_legend_handles_labels()
    if s.tool_calls is not None:  # multi-turn episodes
        ax_t = ax_l.twinx()
        ax_t.plot(s.steps, s.tool_calls, marker="^", ms=3, color="tab:green",
                  label="tool calls per episode")  # fmt: skip
        ax_t.set_ylabel("tool calls")
        more = ax_t.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax_l.legend(handles, labels, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3,
                fontsize="x-small", frameon=False)  # fmt: skip
    ax_l.grid(alpha=0.3)
    title = "reward, held-out accuracy and lag" if s.held_out else "reward and lag"
    fig.suptitle(f"{Path(run_dir).name}: {title} per step")
    fig.tight_layout()
    out = Path(run_dir) / PLOT_NAME
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
