"""Training checkpoints with orbax: params, optimizer state, step, data position (the consumed
problem positions, `trainer.positions`), weight version, attempt and the trainer's RNG, so a
resumed run continues the same sequence of updates on exactly the problems not yet consumed.

Layout: ``DIR/<step>/params`` (params and step) and ``DIR/<step>/opt_state`` (the optimizer
state), written shard by shard by orbax and restored straight onto the mesh of the
`abstract_state` target, and ``DIR/<step>/progress`` (JSON: step, data frontier and consumed
positions beyond it, weight version, attempt, RNG key data). Only the newest checkpoint keeps
``opt_state`` (Adam's two moments: two thirds of a checkpoint): each save deletes it from the
older ones, so the 135M main job's three checkpoints take about 1.4 + 2 x 0.47 GB, not
3 x 1.4 GB. An
older checkpoint restores with zero optimizer state (fresh moments, schedule count 0: export
and a resume past a damaged newest one). Checkpoints of the earlier layout (one ``state``
item) still restore. Saves
are synchronous: when `save` returns, the checkpoint is complete on disk (orbax writes to a
temporary folder and renames it, so a crash mid-save leaves the previous checkpoints intact).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from trainer.positions import ConsumedPositions
from trainer.train_step import TrainState
from trainer.user_error import UserError

log = logging.getLogger(__name__)
OPT_STATE = "opt_state"


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where the run stands, besides the arrays.

    Attributes:
      step: updates applied (equals ``TrainState.step``).
      data_position: the data frontier: every problem position below it was consumed
        (trained or filtered); prompts in flight at the save are not counted.
      weight_version: the version engines must load to serve these params.
      rng: the trainer's PRNG key (a typed key array, e.g. ``jax.random.key(0)``).
      consumed_beyond: consumed positions above the frontier, ascending.
      attempt: how many times the run was resumed before this save (0: the first run).
    """

    step: int
    data_position: int
    weight_version: int
    rng: jax.Array
    consumed_beyond: tuple[int, ...] = ()
    attempt: int = 0

    @property
    def consumed(self) -> ConsumedPositions:
        """The data position as a `ConsumedPositions` (for a `PositionLedger`)."""
        return ConsumedPositions(self.data_position, self.consumed_beyond)

    def to_meta(self) -> dict:
        """The JSON form saved as ``DIR/<step>/progress`` (the RNG as its impl and key data)."""
        return {
            "step": self.step,
            "data_position": self.data_position,
            "weight_version": self.weight_version,
            "consumed_beyond": list(self.consumed_beyond),
            "attempt": self.attempt,
            "rng_impl": str(jax.random.key_impl(self.rng)),
            "rng_data": np.asarray(jax.random.key_data(self.rng)).tolist(),
        }

    @classmethod
    def from_meta(cls, meta: dict) -> Progress:
        """The inverse of `to_meta` (missing consumed_beyond / attempt: () / 0)."""
        rng = jax.random.wrap_key_data(
            jax.numpy.asarray(meta["rng_data"], jax.numpy.uint32), impl=meta["rng_impl"]
        )
        return cls(
            step=int(meta["step"]),
            data_position=int(meta["data_position"]),
            weight_version=int(meta["weight_version"]),
            rng=rng,
            consumed_beyond=tuple(int(p) for p in meta.get("consumed_beyond", ())),
            attempt=int(meta.get("attempt", 0)),
        )


def _state_tree(state: TrainState) -> dict:
    """The layout written before optimizer state got its own item (one ``state`` item)."""
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


def _params_tree(state: TrainState) -> dict:
    return {"params": state.params, "step": state.step}


def _zeros_like(abstract: Any) -> Any:
    """Zeros of every leaf of an abstract pytree, on its leaf's sharding (fresh Adam moments
    and a schedule count of 0)."""
    return jax.tree.map(
        lambda a: jax.numpy.zeros(a.shape, a.dtype, device=getattr(a, "sharding", None)), abstract
    )


class Checkpointer:
    """Saves and restores checkpoints in `directory` (created if missing).

    Args:
      directory: the checkpoint folder (e.g. ``RUN_DIR/checkpoints``).
      max_to_keep: newest checkpoints kept; older ones are deleted after each save.

    Use as a context manager, or call `close`.
    """

    def __init__(self, directory: str | Path, max_to_keep: int = 3):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1; got {max_to_keep}")
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def save(self, state: TrainState, progress: Progress) -> None:
        """Write `state` and `progress` as checkpoint number ``progress.step``; blocks until done.

        Raises:
          ValueError: if ``progress.step`` differs from ``state.step`` or is already saved.
        """
        if int(state.step) != progress.step:
            raise ValueError(f"progress.step {progress.step} != state.step {int(state.step)}")
        if progress.step in self._manager.all_steps():
            raise ValueError(f"checkpoint {progress.step} already exists in {self.directory}")
        meta = progress.to_meta()
        self._manager.save(
            progress.step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(_params_tree(state)),
                opt_state=ocp.args.StandardSave(state.opt_state),
                progress=ocp.args.JsonSave(meta),
            ),
        )
        self._manager.wait_until_finished()
        self._drop_older_optimizer_state(progress.step)

    def _drop_older_optimizer_state(self, newest: int) -> None:
        """Delete the ``opt_state`` item of every checkpoint older than `newest` (process 0
        does it: the folder is shared)."""
        if jax.process_index() != 0:
            return
        for step in self._manager.all_steps():
            if step < newest:
                shutil.rmtree(self.path_of(step) / OPT_STATE, ignore_errors=True)

    def has_optimizer_state(self, step: int) -> bool:
        """Whether checkpoint `step` holds the optimizer state (only the newest keeps it)."""
        folder = self.path_of(step)
        return (folder / OPT_STATE).is_dir() or (folder / "state").is_dir()

    def path_of(self, step: int) -> Path:
        """The folder of checkpoint `step` (it may not exist)."""
        return self.directory / str(step)

    def latest_step(self) -> int | None:
        """The newest saved step, or None when there is no checkpoint."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Saved steps, oldest first."""
        return sorted(self._manager.all_steps())

    def restore(
        self, abstract_state: TrainState, step: int | None = None
    ) -> tuple[TrainState, Progress]:
        """Read checkpoint `step` (default: the newest) onto the shardings of `abstract_state`
        (``TrainStep.abstract_state()``).

        Raises:
          FileNotFoundError: if there is no checkpoint (or not that step) in the directory.
          UserError: the checkpoint cannot be read (`damaged`: names the step, its folder and
            the previous checkpoint).
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint {'at all' if step is None else step} in {self.directory}; "
                f"saved steps: {self.all_steps()}"
            )
        try:
            return self._restore(abstract_state, step)
        except Exception as err:  # orbax / tensorstore / JSON errors of a damaged folder
            raise self.damaged(step, err) from err

    def _restore(self, abstract_state: TrainState, step: int) -> tuple[TrainState, Progress]:
        if (self.path_of(step) / "state").is_dir():  # written before opt_state was an item
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(_state_tree(abstract_state)),
                    progress=ocp.args.JsonRestore(),
                ),
            )
            tree = out["state"]
            return (
                TrainState(tree["params"], tree["opt_state"], tree["step"]),
                Progress.from_meta(out["progress"]),
            )
        items = {
            "params": ocp.args.StandardRestore(_params_tree(abstract_state)),
            "progress": ocp.args.JsonRestore(),
        }
        kept = self.has_optimizer_state(step)
        if kept:
            items["opt_state"] = ocp.args.StandardRestore(abstract_state.opt_state)
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        if kept:
            opt_state = out["opt_state"]
        else:
            log.warning(
                "checkpoint step %d holds no optimizer state (only the newest keeps it): the "
                "optimizer's moments and schedule count restart from zero", step
            )  # fmt: skip
            opt_state = _zeros_like(abstract_state.opt_state)
        tree = out["params"]
        return TrainState(tree["params"], opt_state, tree["step"]), Progress.from_meta(
            out["progress"]
        )

    def damaged(self, step: int, err: BaseException) -> UserError:
        """The plain error of checkpoint `step` that cannot be read: its step and folder, the
        first line of the cause, and the previous checkpoint to resume from (if any)."""
        cause = (str(err).strip().splitlines() or [""])[0][:200]
        older = [s for s in self.all_steps() if s < step]
        if older:
            moments = "" if self.has_optimizer_state(older[-1]) else ", optimizer moments reset"
            offer = (
                f"delete {self.path_of(step)} to resume from step {older[-1]} "
                f"({self.path_of(older[-1])}{moments}), or start over with another run_dir"
            )
        else:
            offer = "there is no earlier checkpoint: start over with another run_dir"
        return UserError(
            f"checkpoint step {step} ({self.path_of(step)}) is damaged and cannot be restored "
            f"({type(err).__name__}: {cause})\n{offer}"
        )

    def close(self) -> None:
        """Finish pending writes and release the manager."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
