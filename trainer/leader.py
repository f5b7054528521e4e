"""Process 0 leads, the other trainer processes follow: the multi-process train loop.

Process 0 runs the whole single-process loop (`trainer.loop.AsyncTrainer`: the gateway client,
scoring, filters, publisher, metrics, checkpoints' progress). Every call of that loop that is a
collective over the trainer processes goes through a wrapper here that first tells the
followers what comes next, so they enter the same collective in the same order:

- ``step``: `LeaderStep`: every process calls `TrainStep`, which shares process 0's `RLBatch`
  (`trainer.global_batch.share_batch`; the followers pass None), and all take the same jitted
  train step on the global ("dp", "fsdp") mesh;
- ``push``: `LeaderPublisher` gathers the params whole onto every process
  (`gather_params`, `multihost_utils.process_allgather`: a collective) and process 0 pushes
  them to the engines as a single-process trainer does. This gather of the whole model is the
  first slice's limit: issue 13 item 2 (every process streams its own shards) replaces it;
- ``save``: `LeaderCheckpointer` passes process 0's `Progress` and every process calls
  orbax's save on the same folder (orbax writes each process's shards and lets process 0
  finalise; the progress JSON is process 0's);
- ``stop``: `Leader.stop`, once, on every way out of process 0's loop (steps done, a
  SIGINT/SIGTERM stop, an error): the followers leave `follow` and shut down.

The op stream goes through the key-value store of JAX's coordination service
(``jaxrl/op/<n>``), not through a device collective: a follower may wait there for minutes
(held-out evaluation, the first rollouts) with no gloo timeout, and it is still watched by the
heartbeats, so if process 0 dies the coordination service ends the follower (and vice
versa, `trainer.distributed`). No process waits alone in a collective: each one is entered
only after its op was posted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from trainer.checkpointing import Checkpointer, Progress
from trainer.models.params import flat_params
from trainer.train_step import TrainState, TrainStep

#: Prefix of the op keys in the coordination service's key-value store.
OP_KEY = "jaxrl/op/"
#: Milliseconds of each blocking read of the next op (a follower reads again after it).
POLL_MS = 10_000


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("the trainer processes have not joined jax.distributed")
    return client


class OpChannel:
    """Numbered messages (JSON objects) from process 0 to the other trainer processes through
    the coordination service's key-value store; each message is read by every follower."""

    def __init__(self) -> None:
        self._client = _client()
        self._next = 0

    def post(self, message: dict[str, Any]) -> None:
        """Process 0: publish the next message (a JSON-able dict with key "op")."""
        self._client.key_value_set(f"{OP_KEY}{self._next}", json.dumps(message))
        self._next += 1

    def receive(self) -> dict[str, Any]:
        """A follower: block until the next message is posted, then return it.

        Raises whatever the coordination client raises other than its read timeout (JAX
        itself ends this process when process 0 dies, `trainer.distributed`).
        """
        key = f"{OP_KEY}{self._next}"
        while True:
            try:
                raw = self._client.blocking_key_value_get(key, POLL_MS)
            except Exception as err:  # jaxlib's XlaRuntimeError: DEADLINE_EXCEEDED
                if "DEADLINE_EXCEEDED" in str(err) or "timed out" in str(err).lower():
                    continue
                raise
            self._next += 1
            return dict(json.loads(raw))


def gather_params(model_or_params: Any) -> dict[str, np.ndarray]:
    """Every param whole on this host (numpy, by dot path), from params sharded over the
    processes' devices. A collective: every trainer process must call it at the same point.
    The gather is the first slice's weight-push path (issue 13 item 2 replaces it)."""
    flat = model_or_params if isinstance(model_or_params, Mapping) else flat_params(model_or_params)
    if jax.process_count() == 1:
        return {k: np.asarray(v) for k, v in flat.items()}
    whole = multihost_utils.process_allgather(dict(flat), tiled=True)
    return {k: np.asarray(v) for k, v in whole.items()}


class Leader:
    """Process 0's side: the op channel and the wrappers `AsyncTrainer` is given instead of
    the step, publisher and checkpointer (each call tells the followers first)."""

    def __init__(self) -> None:
        self.channel = OpChannel()
        self.stopped = False

    def post(self, op: str, **fields: Any) -> None:
        """Tell the followers what comes next (op "step", "push", "save" or "stop")."""
        if self.stopped:
            raise RuntimeError(f"op {op!r} after the followers were told to stop")
        self.channel.post({"op": op, **fields})

    def stop(self, reason: str = "") -> None:
        """Tell the followers to leave (idempotent); call on every way out."""
        if not self.stopped:
            self.post("stop", reason=reason)
            self.stopped = True

    def __enter__(self) -> Leader:
        return self

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> None:
        """On every way out of the ``with`` block the followers are told to stop, with the
        reason: "training and evaluation finished", or the error's type and message."""
        done = "training and evaluation finished"
        self.stop(done if err is None else f"{type(err).__name__}: {err}"[:1000])


class LeaderStep:
    """A `TrainStep` whose call first has every process join: process 0's batch goes to all
    (`TrainStep` calls `share_batch`) and all take the step. Other attributes are the step's."""

    def __init__(self, step: TrainStep, leader: Leader) -> None:
        self._step, self._leader = step, leader

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, float]]:
        """As `TrainStep.__call__`, on every process."""
        self._leader.post("step")
        return self._step(state, batch)  # it shares process 0's batch (share_batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)


class LeaderPublisher:
    """A publisher whose push first gathers the params onto every process (a collective), then
    pushes them from process 0 (`gather_params`). Other attributes are the publisher's."""

    def __init__(self, publisher: Any, leader: Leader) -> None:
        self._publisher, self._leader = publisher, leader

    def push(self, model: Any, version: int) -> Any:
        """As the publisher's push (weights of `model` as `version`)."""
        self._leader.post("push", version=int(version))
        return self._publisher.push(gather_params(model), version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._publisher, name)


class LeaderCheckpointer:
    """A `Checkpointer` whose save is taken by every process on the same folder (process 0's
    `Progress` travels with the op). Other attributes are the checkpointer's."""

    def __init__(self, checkpointer: Checkpointer, leader: Leader) -> None:
        self._checkpointer, self._leader = checkpointer, leader

    def save(self, state: TrainState, progress: Progress) -> None:
        """As `Checkpointer.save`, on every process."""
        self._leader.post("save", progress=progress.to_meta())
        self._checkpointer.save(state, progress)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._checkpointer, name)


def follow(step: TrainStep, state: TrainState, checkpointer: Checkpointer) -> tuple[int, str]:
    """A follower's loop: take every op process 0 posts until "stop"; returns (the train
    steps taken, process 0's stop reason).

    Raises:
      ValueError: an op this version does not know (process 0 and this process differ).
    """
    channel, steps = OpChannel(), 0
    while True:
        message = channel.receive()
        op = message["op"]
        if op == "step":
            state, _ = step(state, None)  # process 0's batch comes by share_batch
            steps += 1
        elif op == "push":
            gather_params(step.model(state))
        elif op == "save":
            checkpointer.save(state, Progress.from_meta(message["progress"]))
        elif op == "stop":
            return steps, str(message.get("reason", ""))
        else:
            raise ValueError(f"unknown op {op!r} from trainer process 0")
