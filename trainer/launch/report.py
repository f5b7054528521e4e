"""What a user sees of a run: a tqdm progress bar, TensorBoard scalars and, at the end, a PNG
plot of reward and lag per step.

`Reporter.on_metrics(row)` takes each line the trainer appends to ``metrics.jsonl`` (a dict of
step metrics, see `trainer.loop`): the bar shows step, mean reward, mean lag and rollout
tokens/s; `on_eval_progress` draws a second bar of held-out groups back during an evaluation;
every numeric entry becomes a TensorBoard scalar under ``RUN_DIR/tensorboard`` at its step
(and, given a `trainer.launch.wandb_log.WandbLogger`, a W&B metric at the same step).
`on_eval_row` takes an evaluation's row of ``metrics.jsonl`` (``eval/*`` keys, see
`trainer.launch.eval_every`). `plot_metrics` (`trainer.launch.plot`) reads ``metrics.jsonl``
back and draws the plot.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from trainer.launch.plot import PLOT_NAME, plot_metrics

__all__ = ["PLOT_NAME", "Reporter", "failure_summary", "format_summary", "is_eval_row",
           "plot_metrics", "read_metrics", "reward_ends"]  # fmt: skip


class Reporter:
    """Progress bar and TensorBoard writer of one run.

    Args:
      run_dir: the run folder (TensorBoard events go to ``run_dir/tensorboard``).
      total_steps: the bar's length. first_step: steps already done (a resumed run).
      show_bar: draw the bar (False: TensorBoard only).
      wandb: also log every metrics row and held-out accuracy to this W&B run (its owner
        finishes it).
    """

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        first_step: int = 0,
        show_bar: bool = True,
        wandb: Any = None,
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self._tqdm = tqdm
        self._show_bar = show_bar
        self.wandb = wandb
        self._eval_bars: dict[str, Any] = {}
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        self.bar = tqdm(
            total=total_steps, initial=first_step, desc="train", unit="step", disable=not show_bar
        )

    def on_metrics(self, row: dict[str, Any]) -> None:
        """One step's metrics: advance the bar, write the scalars.

        Raises:
          KeyError: the row has no "step".
        """
        step = int(row["step"])
        for key, value in row.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, float(value), step)
        self.writer.flush()
        if self.wandb is not None:
            self.wandb.on_metrics(row)
        self.bar.set_postfix(
            reward=f"{row.get('reward_mean', float('nan')):.3f}",
            lag=f"{row.get('lag_mean', float('nan')):.2f}",
            tok_s=f"{row.get('tokens_per_s', float('nan')):.0f}",
            refresh=False,
        )
        self.bar.update(1)

    def on_eval_progress(self, tag: str, back: int, total: int) -> None:
        """An evaluation's progress: `back` of its `total` held-out groups returned. Draws a
        bar "eval TAG" (unit: group) below the training bar, closed once all are back.

        Raises:
          ValueError: back < 0 or back > total.
        """
        if not 0 <= back <= total:
            raise ValueError(f"eval progress {back}/{total} is out of range")
        bar = self._eval_bars.get(tag)
        if bar is None:
            bar = self._tqdm(
                total=total, desc=f"eval {tag}", unit="group", position=1, leave=False,
                mininterval=0, disable=not self._show_bar,
            )  # fmt: skip
            self._eval_bars[tag] = bar
        bar.update(back - bar.n)
        if back == total:
            bar.close()
            del self._eval_bars[tag]

    def on_eval(self, tag: str, accuracy: float, step: int) -> None:
        """A held-out accuracy ("eval/accuracy" at `step`) and a line under the bar."""
        self.writer.add_scalar("eval/accuracy", accuracy, step)
        self.writer.flush()
        if self.wandb is not None:
            self.wandb.on_eval(accuracy, step)
        self.bar.write(f"held-out accuracy {tag} (step {step}): {accuracy:.3f}")

    def on_eval_row(self, row: dict[str, Any]) -> None:
        """An evaluation's metrics.jsonl row (`trainer.launch.eval_every.eval_row`, or an error
        row with ``eval/error``): its numeric ``eval/*`` values as TensorBoard scalars (and W&B
        metrics, given a logger) at its step, and a line under the bar.

        Raises:
          KeyError: the row has no "step" or no "eval/tag".
        """
        step, tag = int(row["step"]), row["eval/tag"]
        values = {
            k: float(v)
            for k, v in row.items()
            if k.startswith("eval/") and isinstance(v, int | float) and not isinstance(v, bool)
        }
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()
        if self.wandb is not None:
            self.wandb.on_metrics({"step": step, **values})
        if "eval/error" in row:
            self.bar.write(f"held-out evaluation {tag} (step {step}) failed: {row['eval/error']}")
        else:
            self.bar.write(
                f"held-out accuracy {tag} (step {step}, version {row['version']}): "
                f"{row['eval/accuracy']:.3f}"
            )

    def close(self) -> None:
        """Close the bars and the writer."""
        for bar in self._eval_bars.values():
            bar.close()
        self._eval_bars.clear()
        self.bar.close()
        self.writer.close()


def is_eval_row(row: dict[str, Any]) -> bool:
    """Whether a metrics.jsonl row is an evaluation's (``eval/tag``), not a training step's."""
    return "eval/tag" in row


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` (empty when it does not exist)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reward_ends(rewards: list[float]) -> dict[str, Any]:
    """The mean reward of the first and the last k steps, k = min(5, n // 2) over n steps, so
    the two never share a step (k = 0 for one step: both are that step's reward), as the job
    summary's ``reward_first5``, ``reward_last5`` and ``reward_ends_steps`` (k); all None
    without a step."""
    if not rewards:
        return {"reward_first5": None, "reward_last5": None, "reward_ends_steps": None}
    k = min(5, len(rewards) // 2)
    first, last = (rewards[:k], rewards[-k:]) if k else (rewards, rewards)
    return {
        "reward_first5": float(sum(first) / len(first)),
        "reward_last5": float(sum(last) / len(last)),
        "reward_ends_steps": k,
    }


def format_summary(result: dict[str, Any]) -> str:
    """The few lines printed at the end of a job: steps, reward of the first and last 5 steps,
    held-out accuracy before and after, wall time and where the outputs are."""
    loop = result["loop"]
    lines = [
        f"{loop['steps']} steps ({result['backend']} engines), weight version {loop['version']}; "
        f"groups: {loop['submitted']} submitted, {loop['trained_groups']} trained, "
        f"{loop['filtered_lag'] + loop['filtered_zero_variance'] + loop['filtered_aborted']} "
        f"filtered, {loop['in_flight']} in flight at the stop",
    ]
    if result.get("reward_first5") is not None:
        k = result.get("reward_ends_steps", 5)
        if k == 0:  # a single step
            lines.append(f"mean reward: {result['reward_first5']:.3f} (one step)")
        else:
            lines.append(
                f"mean reward: first {k} steps {result['reward_first5']:.3f}, "
                f"last {k} steps {result['reward_last5']:.3f}"
            )
    before, after = result.get("eval_before"), result.get("eval_after")
    if before and after:
        lines.append(
            f"held-out accuracy ({after['problems']} problems x {after['samples']}): "
            f"{before['accuracy']:.3f} before (v{before['version']}) -> "
            f"{after['accuracy']:.3f} after (v{after['version']})"
        )
    every = result.get("eval_every")
    if every:
        done = ", ".join(f"v{e['version']} {e['accuracy']:.3f}" for e in every["evaluations"])
        lines.append(
            f"held-out accuracy every {every['every']} steps: {done or 'none'}"
            + (f"; {len(every['failures'])} evaluations failed" if every["failures"] else "")
        )
    reason = result.get("stop_reason", "completed")
    if reason != "completed":
        lines.append(
            f"stopped: {reason}; checkpoint at step {loop['steps']} (rerun the same command "
            "to resume)"
        )
    if "wall_time_s" in result:
        lines.append(f"wall time {result['wall_time_s']:.0f} s")
    if result.get("plot"):
        lines.append(f"plot: {_shown(Path(result['plot']))}")
    return "\n".join(lines)


def _shown(path: Path) -> Path:
    """`path` relative to the working folder when it lies inside it (as the run folder is
    printed), else as given."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def failure_summary(run_dir: str | Path, err: BaseException, started: float) -> dict[str, Any]:
    """The job summary of a run that ended with `err` (an exception or a forced interrupt):
    the reason, the loop totals of ``run_dir/summary.json`` when this run wrote it (modified
    after `started`, a `time.time()` in seconds), the saved checkpoint steps, the last step in
    ``metrics.jsonl`` and the wall time."""
    run = Path(run_dir)
    loop_file = run / "summary.json"
    loop = None
    if loop_file.exists() and loop_file.stat().st_mtime >= started:
        loop = json.loads(loop_file.read_text())
    ckpt = run / "checkpoints"
    steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.is_dir() else []
    try:
        rows = read_metrics(run)
    except ValueError:  # a line torn by a kill mid-write
        rows = []
    return {
        "stop_reason": f"{type(err).__name__}: {err}",
        "exit_code": None,
        "loop": loop,
        "checkpoint_steps": steps,
        "last_metrics_step": rows[-1]["step"] if rows else None,
        "wall_time_s": time.time() - started,
    }
