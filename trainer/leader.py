"""Process 0 leads, the other trainer processes follow: the multi-process train loop.

Process 0 runs the whole single-process loop (`trainer.loop.AsyncTrainer`: the gateway client,
scoring, filters, publisher, metrics, checkpoints' progress). Every call of that loop that is a
collective over the trainer processes goes through a wrapper here that first tells the
followers what comes next, so they enter the same collective in the same order:

- ``step``: `LeaderStep`: every process calls `TrainStep`, which shares process 0's `RLBatch`
  (`trainer.global_batch.share_batch`; the followers pass None), and all take the same jitted
  train step on the global ("dp", "fsdp", "tp") mesh;
- ``push``: over gloo, NCCL or jax_transfer every process makes its own blocks of
  the new version (`trainer.publish.local_shards`: the cast and layout change run sharded,
  a collective) and is one sender of it (`transport.fan_in`): process 0's publisher runs the
  push and, each time it publishes a plan (the push, a re-plan after engines died, a
  catch-up of a restarted engine, which may come from the publisher's catch-up thread), posts
  ``send`` with it, and every follower joins that group as one more sender of its blocks
  (`trainer.publish.co_sender`). No process gathers a whole tensor. Over the file or shm data
  plane (one writer per version) the params are gathered onto every process instead
  (`gather_params`) and process 0 writes them;
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
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from trainer.checkpointing import Checkpointer, Progress
from trainer.publish.co_sender import FollowerSends
from trainer.publish.host_views import flat_of
from trainer.publish.local_shards import engine_arrays, local_blocks
from trainer.train_step import TrainState, TrainStep
from transport.config import JaxTransferTransportConfig, TransportConfig, serves_blocks
from transport.sync_plan import SyncPlan

#: Prefix of the op keys in the coordination service's key-value store.
OP_KEY = "jaxrl/op/"
#: Milliseconds of each blocking read of the next op (a follower reads again after it).
POLL_MS = 10_000
#: Prefix of the keys where each trainer process leaves its transfer server's address.
TRANSFER_KEY = "jaxrl/transfer/"


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
        self._lock = threading.Lock()  # the loop and the publisher's catch-up thread post

    def post(self, message: dict[str, Any]) -> None:
        """Process 0: publish the next message (a JSON-able dict with key "op"); safe to call
        from several threads (each message gets its own number)."""
        with self._lock:
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
    """Every param whole in this process (numpy, by dot path), from params sharded over the
    processes' devices. A collective: every trainer process must call it at the same point.
    The push path of the file and shm data planes with several trainer processes (over gloo,
    NCCL and jax_transfer each process sends its own blocks instead,
    `transport.config.serves_blocks`)."""
    flat = flat_of(model_or_params)
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
        """Tell the followers what comes next (op "step", "push", "send", "save" or "stop").

        Raises:
            RuntimeError: after `stop`.
        """
        if self.stopped:
            raise RuntimeError(f"op {op!r} after the followers were told to stop")
        self.channel.post({"op": op, **fields})

    def announce(self, plan: SyncPlan) -> None:
        """The publisher's `announce`: have every follower join `plan`'s group as a sender
        of its blocks of the plan's version (op "send")."""
        self.post("send", version=plan.version, plan=plan.to_params())

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
    """A publisher whose push first has every process make its blocks of the version (a
    collective) and then pushes process 0's, the others sending theirs as each plan is
    announced (gloo, NCCL, jax_transfer: `transport.config.serves_blocks`); over the file or
    shm data plane it gathers the params onto every process and pushes them from process 0
    (`gather_params`). Other attributes are the publisher's."""

    def __init__(self, publisher: Any, leader: Leader) -> None:
        self._publisher, self._leader = publisher, leader

    def push(self, model: Any, version: int) -> Any:
        """As the publisher's push (weights of `model` as `version`)."""
        self._leader.post("push", version=int(version))
        p = self._publisher
        if not serves_blocks(p.transport):
            return p.push(gather_params(model), version)
        tensors = engine_arrays(p.family, p.cfg, flat_of(model), p.dtype, p.jax_dims)
        on_device = isinstance(p.transport, JaxTransferTransportConfig)
        return p.push_blocks(local_blocks(tensors, int(version), 0, on_device))

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


def with_transfer_servers(transport: TransportConfig, timeout_s: float = 300.0) -> Any:
    """Over jax_transfer, `transport` with `servers` filled in: every trainer process's
    transfer server address (`transport.jax_transfer.server_for`, started here), in process
    order. Every trainer process calls it once at the start: each leaves its address in the
    coordination service's key-value store (``jaxrl/transfer/<process>``) and process 0 reads
    them all. Any other transport comes back unchanged.

    Raises:
        TimeoutError: process 0 did not get every address within `timeout_s` seconds.
        TransferError: this process's server did not start.
    """
    from transport.jax_transfer import address_of

    if not isinstance(transport, JaxTransferTransportConfig):
        return transport
    own = address_of(transport.host)
    if jax.process_count() == 1:
        return transport.model_copy(update={"servers": (own,)})
    client, me = _client(), jax.process_index()
    client.key_value_set(f"{TRANSFER_KEY}{me}", own)
    if me != 0:
        return transport
    servers = []
    for p in range(jax.process_count()):
        try:
            servers.append(
                str(client.blocking_key_value_get(f"{TRANSFER_KEY}{p}", int(timeout_s * 1e3)))
            )
        except Exception as err:  # jaxlib's XlaRuntimeError: DEADLINE_EXCEEDED
            raise TimeoutError(f"trainer process {p} left no transfer server address within "
                               f"{timeout_s} s: {err}") from err  # fmt: skip
    return transport.model_copy(update={"servers": tuple(servers)})


def follow(
    step: TrainStep,
    state: TrainState,
    checkpointer: Checkpointer,
    sends: FollowerSends | None = None,
) -> tuple[int, str]:
    """A follower's loop: take every op process 0 posts until "stop"; returns (the train
    steps taken, process 0's stop reason).

    Args:
        sends: this process's part of the pushes over a data plane every process sends on
            (`transport.config.serves_blocks`); None gathers the params at each push (the
            file and shm data planes).

    Raises:
      ValueError: an op this version does not know (process 0 and this process differ), or
        a "send" without `sends`.
    """
    channel, steps = OpChannel(), 0
    while True:
        message = channel.receive()
        op = message["op"]
        if op == "step":
            state, _ = step(state, None)  # process 0's batch comes by share_batch
            steps += 1
        elif op == "push" and sends is not None:
            sends.prepare(flat_of(step.model(state)), int(message["version"]))
        elif op == "push":
            gather_params(step.model(state))
        elif op == "send":
            if sends is None:
                raise ValueError("op 'send' from trainer process 0, but this process has no "
                                 "sender (its data plane is not a collective one)")  # fmt: skip
            sends.send(message["plan"], int(message["version"]))
        elif op == "save":
            checkpointer.save(state, Progress.from_meta(message["progress"]))
        elif op == "stop":
            return steps, str(message.get("reason", ""))
        else:
            raise ValueError(f"unknown op {op!r} from trainer process 0")
