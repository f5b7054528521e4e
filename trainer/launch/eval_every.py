"""In-loop held-out evaluation (``eval.every=N``): after every N-th training step the main job
evaluates the held-out split at that step's weight version on the running engines.

`EvalEvery` is `AsyncTrainer`'s ``after_update`` hook. At a due step (a multiple of N, except
the run's last step: the end-of-run evaluation follows at that same version) it
1. stops the `RolloutSource`'s fetching thread, so that the evaluation alone fetches from the
   gateway; the training groups it fetches meanwhile go to `RolloutSource.accept`, queued for
   the next update as the thread would have queued them (none lost, none twice);
2. submits the held-out problems as eval prompts at ``min_version`` = the step's version (the
   engines hold exactly that version: the trainer pushes the next one only after this hook
   returns) and scores them (`trainer.launch.evaluate.evaluate`, the caller's `evaluate`);
3. starts the fetching thread again and hands the result, as `eval_row`, to `log` (the job:
   a row of metrics.jsonl, TensorBoard scalars under ``eval/``, a line under the bar).

A fault of the evaluation itself - the gateway refusing the eval prompts (`GatewayError`) or no
group back for eval.timeout_s (`TimeoutError`) - does not stop training: it is logged (an error
line, and a row with ``eval/error`` for `log`), kept in `failures`, and training goes on with
the same steps; eval groups that come back later are dropped by the source
(``stale_eval_groups``). Any other error (a training group that was never submitted, a verifier
crash) propagates and ends the run through the loop's failure path (checkpoint, stop_reason).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway import messages as m
from gateway.errors import GatewayError
from trainer.launch.evaluate import EvalResult
from trainer.rollout_source import RolloutSource

log = logging.getLogger(__name__)

Evaluate = Callable[[str, int, Callable[[m.RolloutGroup], None]], EvalResult]
"""(tag, version, on_training_group) -> the evaluation's result."""


@dataclasses.dataclass(frozen=True)
class EvalFailure:
    """An in-loop evaluation that failed: at `step` (weight `version`), `error` its text."""

    step: int
    version: int
    error: str


def eval_row(result: EvalResult, step: int) -> dict[str, Any]:
    """The metrics.jsonl row of one evaluation at training `step`: ``step``, ``version``,
    ``eval/tag`` and ``eval/accuracy`` (mean reward), ``eval/pass@k``, ``eval/maj@k``,
    ``eval/mean_length`` (tokens), ``eval/length_cut_fraction``, ``eval/problems``,
    ``eval/samples``, ``eval/seconds`` (wall time) and ``eval/drained`` (training groups fetched
    meanwhile)."""
    return {
        "step": step,
        "version": result.version,
        "eval/tag": result.tag,
        "eval/accuracy": result.accuracy,
        **{f"eval/{k}": v for k, v in result.metrics.items()},
        "eval/problems": result.problems,
        "eval/samples": result.samples,
        "eval/seconds": result.seconds,
        "eval/drained": result.drained,
    }


def append_row(run_dir: str | Path, row: dict[str, Any]) -> None:
    """Append `row` as one line of ``run_dir/metrics.jsonl`` (eval rows carry ``eval/tag``)."""
    with (Path(run_dir) / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


class EvalEvery:
    """The ``after_update`` hook that evaluates every `every` steps (see the module docstring).

    Args:
      every: steps between evaluations (0: never). last_step: the run's last step
        (trainer.steps), left to the end-of-run evaluation.
      evaluate: runs one evaluation (`Evaluate`); the hook passes it `source.accept`.
      source: the loop's rollout source (its fetching thread is stopped meanwhile).
      log: called with each row (`eval_row`, or an error row) at once.

    Raises:
      ValueError: every < 0.
    """

    def __init__(
        self,
        every: int,
        last_step: int,
        evaluate: Evaluate,
        source: RolloutSource,
        log: Callable[[dict[str, Any]], None],
    ) -> None:
        if every < 0:
            raise ValueError(f"eval.every: expected >= 0, got {every}")
        self.every = every
        self.last_step = last_step
        self.evaluate = evaluate
        self.source = source
        self.log = log
        self.results: list[EvalResult] = []
        self.failures: list[EvalFailure] = []

    def due(self, step: int) -> bool:
        """Whether `step` is evaluated here (a multiple of `every`, not the last step)."""
        return self.every > 0 and step % self.every == 0 and step != self.last_step

    def __call__(self, step: int, version: int) -> None:
        """Evaluate at `version` when `step` is due (see the module docstring).

        Raises:
          what `evaluate` raises other than GatewayError and TimeoutError.
        """
        if not self.due(step):
            return
        tag = f"step{step}"
        self.source.stop()  # the evaluation fetches alone; training groups go to accept
        try:
            result = self.evaluate(tag, version, self.source.accept)
        except (GatewayError, TimeoutError) as err:
            error = f"{type(err).__name__}: {err}"
            log.error("held-out evaluation at step %d (version %d) failed, training goes on: %s",
                      step, version, error)  # fmt: skip
            self.failures.append(EvalFailure(step, version, error))
            self.log({"step": step, "version": version, "eval/tag": tag, "eval/error": error})
            return
        finally:
            self.source.start()
        self.results.append(result)
        self.log(eval_row(result, step))

    def summary(self) -> dict[str, Any]:
        """For the job summary: every, the evaluations (step, version, accuracy), the failures,
        and the eval groups the source dropped after a failure."""
        return {
            "every": self.every,
            "evaluations": [
                {"tag": r.tag, "version": r.version, "accuracy": r.accuracy} for r in self.results
            ],
            "failures": [dataclasses.asdict(f) for f in self.failures],
            "stale_eval_groups": self.source.stale_eval_groups,
        }
