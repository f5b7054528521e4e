"""Weights & Biases beside TensorBoard (``logging.wandb``): every metrics row the trainer writes to
``metrics.jsonl`` at its step (same names), the held-out accuracy, the job config, and every
``samples_every`` steps a table of sample completions (step, prompt, completion, reward, weight
version).

`wandb_run(job, run_dir, decode, config)` (`start_wandb`) calls ``wandb.init`` when the job starts,
before any process, so a W&B that cannot start (no API key online, an init timeout, wandb not
installed) fails the job in seconds naming ``logging.wandb``, never mid-run. wandb is imported only
there: a run with ``logging.wandb.mode=disabled`` (the default) does not need it. Offline mode
writes ``DIR/wandb/offline-run-*/`` without touching the network (`wandb sync` uploads it later).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from trainer.launch.job_config import JobConfig, WandbSection
from trainer.rollouts import RolloutGroup

SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward", "weight_version")
"""Columns of the sample table: the update that trained on the group, the prompt and completion
texts (special tokens left out), the completion's reward and the weight version it was sampled
at (its first token's)."""


class WandbLogger:
    """One W&B run's sink: metrics rows, held-out accuracy and sample tables.

    Args:
      run: the started ``wandb`` run. cfg: the ``logging.wandb`` section.
      decode: token ids -> text (the prompt and completion columns).
    """

    def __init__(self, run: Any, cfg: WandbSection, decode: Callable[[Sequence[int]], str]) -> None:
        self.run = run
        self.cfg = cfg
        self.decode = decode
        self.tables_logged = 0

    def on_metrics(self, row: dict[str, Any]) -> None:
        """One metrics.jsonl row: its numeric entries logged at its ``step`` (bools and
        strings left out, as in TensorBoard).

        Raises:
          KeyError: the row has no "step".
        """
        step = int(row["step"])
        scalars = {
            k: float(v)
            for k, v in row.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
        }
        self.run.log(scalars, step=step)

    def on_eval(self, accuracy: float, step: int) -> None:
        """A held-out accuracy, logged as ``eval/accuracy`` at `step`."""
        self.run.log({"eval/accuracy": float(accuracy)}, step=step)

    def wants_samples(self, step: int) -> bool:
        """True at step 1 and every ``samples_every`` steps (never when it is 0)."""
        every = self.cfg.samples_every
        return every > 0 and (step == 1 or step % every == 0)

    def on_groups(self, step: int, groups: Sequence[RolloutGroup]) -> None:
        """The groups update `step` trained on: at the steps `wants_samples` names, a table
        ``samples`` of the first completion of each of the first ``samples_per_table`` groups."""
        if not self.wants_samples(step):
            return
        import wandb

        table = wandb.Table(columns=list(SAMPLE_COLUMNS))
        for group in list(groups)[: self.cfg.samples_per_table]:
            c = group.completions[0]
            text = c.text if c.text is not None else self.decode([int(t) for t in c.token_ids])
            reward = float(c.reward) if c.reward is not None else float("nan")
            table.add_data(step, self.decode([int(t) for t in group.prompt_ids]), text, reward,
                           int(c.version_start))  # fmt: skip
        self.run.log({"samples": table}, step=step)
        self.tables_logged += 1

    def close(self, exit_code: int = 0) -> None:
        """Finish the run (flushes everything to its folder; offline: ``wandb sync`` can upload
        it). `exit_code` != 0 marks it failed."""
        self.run.finish(exit_code=exit_code)


def wandb_dir(cfg: WandbSection, run_dir: Path) -> Path:
    """The folder W&B writes ``wandb/`` under: logging.wandb.dir, else $WANDB_DIR, else the
    run folder."""
    return Path(cfg.dir or os.environ.get("WANDB_DIR") or run_dir)


def start_wandb(
    job: JobConfig,
    run_dir: Path,
    decode: Callable[[Sequence[int]], str],
    config: dict[str, Any],
) -> WandbLogger | None:
    """Start the W&B run of `job` (None when logging.wandb.mode is disabled) with `config` (the
    job config as plain data, what ``RUN_DIR/config.yaml`` holds) as the run's config.

    Raises:
      RuntimeError: wandb is not installed, or ``wandb.init`` failed (no API key in online
        mode, a timeout, an unwritable folder): the message names logging.wandb and the cause.
    """
    cfg = job.logging.wandb
    if cfg.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError as err:
        raise RuntimeError(
            f"logging.wandb.mode={cfg.mode} needs the wandb package (pip install wandb): {err}"
        ) from err
    directory = wandb_dir(cfg, run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        run = wandb.init(
            project=cfg.project, entity=cfg.entity, name=cfg.name or run_dir.name,
            tags=list(cfg.tags), dir=str(directory), mode=cfg.mode, config=config,
            settings=wandb.Settings(init_timeout=cfg.init_timeout_s, silent=True),
        )  # fmt: skip
    except Exception as err:
        raise RuntimeError(
            f"logging.wandb: wandb.init failed (mode={cfg.mode}, project={cfg.project!r}, "
            f"entity={cfg.entity!r}, dir={directory}): {type(err).__name__}: {err}"
        ) from err
    return WandbLogger(run, cfg, decode)


@contextlib.contextmanager
def wandb_run(
    job: JobConfig,
    run_dir: Path,
    decode: Callable[[Sequence[int]], str],
    config: dict[str, Any],
) -> Iterator[WandbLogger | None]:
    """`start_wandb` on entry; on exit the run is finished, marked failed (exit code 1) when
    the block raised.

    Raises:
      RuntimeError: as `start_wandb` (on entry).
    """
    logger = start_wandb(job, run_dir, decode, config)
    if logger is None:
        yield None
        return
    try:
        yield logger
    except BaseException:
        logger.close(exit_code=1)
        raise
    logger.close()
