"""The global batch of a multi-process train step: process 0's `RLBatch`, on every process.

Choice: a broadcast from process 0, not `jax.make_array_from_process_local_data`. One process
owns the gateway client (prompts out, groups in, scoring, filters), so the batch exists on
process 0 only; per-process rows would mean sending every other process its rows first and
keeping each process's data position, retries and filters in step. The batch is small next to
the weights (B * L * 5 arrays of 4 bytes: 0.3 MB for 32 x 512), one broadcast per step costs
little, and then every process holds the whole host batch, so the placement onto the mesh is
exactly the single-process one (`models.sharding.place`: each process puts only its rows) and
host-side metrics (`RLBatch.metrics`) agree on every process.

The broadcast is `jax.experimental.multihost_utils.broadcast_one_to_all` (a psum over all
devices with zeros from the other processes: exact for floats and ints). It runs in two
rounds: the shape [B, L], then the arrays, since the followers do not know B and L.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from trainer.batch import RLBatch

#: Per field: (rank, dtype) of an `RLBatch` built by `trainer.batch.build_rl_batch`.
FIELDS: dict[str, tuple[int, np.dtype]] = {
    "tokens": (2, np.dtype(np.int32)),
    "positions": (2, np.dtype(np.int32)),
    "targets": (2, np.dtype(np.int32)),
    "sampler_logprobs": (2, np.dtype(np.float32)),
    "loss_mask": (2, np.dtype(np.float32)),
    "prompt_lens": (1, np.dtype(np.int32)),
    "seq_lens": (1, np.dtype(np.int32)),
    "rewards": (1, np.dtype(np.float32)),
    "group_mean": (1, np.dtype(np.float32)),
    "group_std": (1, np.dtype(np.float32)),
    "advantages": (1, np.dtype(np.float32)),
    "group_index": (1, np.dtype(np.int32)),
    "version_start": (1, np.dtype(np.int32)),
    "lag": (1, np.dtype(np.int32)),
    "token_versions": (2, np.dtype(np.int32)),
}


def batch_fields(batch: RLBatch) -> dict[str, np.ndarray]:
    """The arrays of `batch` by field name, checked against `FIELDS`.

    Raises:
      ValueError: a field of another shape or dtype (named, with both).
    """
    b, length = batch.num_rows, batch.length
    out = {}
    for name, (rank, dtype) in FIELDS.items():
        x = np.asarray(getattr(batch, name))
        want = (b, length) if rank == 2 else (b,)
        if x.shape != want or x.dtype != dtype:
            raise ValueError(f"RLBatch.{name}: expected {want} {dtype}, got {x.shape} {x.dtype}")
        out[name] = x
    return out


def share_batch(batch: RLBatch | None) -> RLBatch:
    """Process 0's host batch on every process (numpy); one process: `batch` as it is.

    Args:
      batch: on process 0 the step's `RLBatch` (host numpy, fields [B, L] / [B] as
        `FIELDS` says); on the other processes None (anything passed there is ignored).

    Every process must call it at the same step (it is a collective).

    Raises:
      ValueError: process 0 passed None or a batch with routes (not shared yet), or a
        field of another shape or dtype (process 0
        raises before any collective; the others then fail at JAX's heartbeat).
    """
    if jax.process_count() == 1:
        if batch is None:
            raise ValueError("share_batch: a single process must pass its batch")
        return batch
    source = jax.process_index() == 0
    if source and batch is None:
        raise ValueError("share_batch: process 0 owns the batch and passed None")
    if source and batch is not None and batch.routes is not None:
        raise ValueError(
            "share_batch: a batch with routes (routing replay) is not shared across trainer "
            "processes yet; run one trainer process"
        )
    arrays, header = None, np.zeros(2, np.int32)
    if source and batch is not None:
        arrays, header = batch_fields(batch), np.array([batch.num_rows, batch.length], np.int32)
    b, length = (int(v) for v in multihost_utils.broadcast_one_to_all(header))
    if arrays is None:
        arrays = {
            name: np.zeros((b, length) if rank == 2 else (b,), dtype)
            for name, (rank, dtype) in FIELDS.items()
        }
    shared = multihost_utils.broadcast_one_to_all(arrays)
    return RLBatch(**{name: np.asarray(shared[name]) for name in FIELDS})
