"""A follower trainer process's part of each push: its own blocks, sent as one more sender.

With several trainer processes (`launch.trainer_processes`), process 0's `WeightPublisher`
runs the push (engines, plan, waits) and every other process takes part through the op
channel (`trainer.leader`):
- op ``push`` (every process, in step): `FollowerSends.prepare` makes this process's blocks of
  the new version (`local_shards.local_blocks`: the cast and layout change are collectives);
- op ``send`` (once per plan: the push, each re-plan after engines died, each catch-up of a
  restarted engine): `FollowerSends.send` joins that plan's data-plane group as sender rank
  `process` and sends its blocks (`transport.fan_in`). A failed send (an engine died, the
  group broke) is logged and left to process 0, which re-plans or fails the push; this
  process waits for its next op.
Over jax_transfer (`transport.jax_transfer`) the blocks stay on this process's devices and
"sending" schedules one pull of them per engine of the plan from this process's transfer
server (its address was given to process 0 at the start, `trainer.leader.
with_transfer_servers`); the engines' "loaded" acks to the gateway are the commit.
Each send is a row of ``RUN_DIR/logs/trainer{process}_sends.jsonl``: version, group, bytes,
buckets, seconds, and the error when it failed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from mappings.registry import get_family
from mappings.spec import Family
from trainer.publish.local_shards import LocalBlocks, engine_arrays, local_blocks
from transport.base import TransferError
from transport.collective import CollectiveSender
from transport.config import (
    GlooTransportConfig,
    JaxTransferTransportConfig,
    TransportConfig,
    serves_blocks,
)
from transport.factory import make_co_sender
from transport.jax_transfer import JaxTransferSender
from transport.manifest import ManifestError
from transport.sync_plan import SyncPlan, SyncPlanError

log = logging.getLogger("trainer.publish")


class FollowerSends:
    """Trainer process `process` (>= 1) as a sender of every push.

    Args:
        family, cfg: the mapping family (name or `Family`) and model config (as process 0's
            publisher has).
        dtype: wire dtype (torch name), the engines' dtype.
        process: this process's index (its group rank as a sender).
        log_path: where each send's row goes (None: nowhere).
        jax_dims: JAX-side sizes that differ from the checkpoint's.
        on_device: keep the blocks on this process's devices (`transport.jax_transfer`:
            the process serves them from there) instead of host copies.
    """

    def __init__(
        self,
        family: str | Family,
        cfg: Any,
        dtype: str,
        process: int,
        log_path: Path | None = None,
        jax_dims: Mapping[str, int] | None = None,
        on_device: bool = False,
    ) -> None:
        if process < 1:
            raise ValueError(f"process: expected a follower (>= 1), got {process}")
        self.family = get_family(family) if isinstance(family, str) else family
        self.cfg, self.dtype, self.process = cfg, dtype, process
        self.log_path, self.jax_dims = log_path, dict(jax_dims or {})
        self.blocks: LocalBlocks | None = None
        self.on_device = on_device
        self._sender: CollectiveSender | JaxTransferSender | None = None
        self._key: tuple | None = None

    def prepare(self, params: Mapping[str, Any], version: int) -> None:
        """Make this process's blocks of `version` from the flat params (a collective: every
        trainer process calls it, process 0 through `LeaderPublisher.push`)."""
        tensors = engine_arrays(self.family, self.cfg, params, self.dtype, self.jax_dims)
        self.blocks = local_blocks(tensors, version, self.process, self.on_device)

    def send(self, plan_params: Mapping[str, str], version: int) -> bool:
        """Join the plan's group as a sender (or stay in it: the group of the last plan is
        kept while process 0 keeps it, i.e. while the plan's group generation and port stay
        the same) and send this process's blocks of `version`; returns whether the version
        committed. Never raises for a failed transfer (logged): process 0 decides what comes
        next.

        A plan this process cannot serve (not a collective transport, malformed, blocks of
        another version or other sources) is logged as an error; the process still joins and
        leaves the group at once, so process 0 fails the attempt now, not at its timeout.
        """
        t0 = time.perf_counter()
        row: dict[str, Any] = {"version": int(version), "process": self.process}
        sender = None
        try:
            plan = SyncPlan.from_params(plan_params, version)
            row["group"] = plan.group
            transport = TypeAdapter(TransportConfig).validate_python(plan.transport)
            if not serves_blocks(transport):
                raise SyncPlanError(f"transport {transport.kind!r} has a single sender")
            sender = self._sender_for(transport, plan)
            blocks = self.blocks
            if blocks is None or blocks.version != version:
                held = None if blocks is None else blocks.version
                raise ManifestError(f"asked to send version {version}, holding {held}")
            if blocks.sources_for(plan.manifest) != plan.manifest.sources:
                raise ManifestError(f"version {version}: the plan's sources are not this one's")
            stats = sender.send(plan.manifest, iter(blocks.mine.items()))
            row.update(ok=True, num_bytes=stats.num_bytes, num_buckets=stats.num_buckets)
        except (TransferError, SyncPlanError, ManifestError, ValueError) as e:
            if isinstance(sender, CollectiveSender) and not isinstance(e, TransferError):
                try:  # join and leave: the group learns it at once
                    sender.connect()
                except TransferError:
                    pass
            self.close()  # a failed collective leaves the group out of step
            log.warning("trainer process %d: sending version %d failed: %s",
                        self.process, version, e)  # fmt: skip
            row.update(ok=False, error=str(e)[:2000])
        row["seconds"] = round(time.perf_counter() - t0, 6)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return bool(row["ok"])

    def _sender_for(
        self, transport: GlooTransportConfig | JaxTransferTransportConfig, plan: SyncPlan
    ) -> CollectiveSender | JaxTransferSender:
        """The co-sender of the plan's group: the kept one when process 0 kept its group
        (same host, port, generation and size), else a new one (the old one closed). A
        jax_transfer sender is this process's one server, told the plan's receivers."""
        if isinstance(transport, JaxTransferTransportConfig):
            if not isinstance(self._sender, JaxTransferSender):
                self.close()
                self._sender = make_co_sender(transport, self.process, plan.world_size)
            assert isinstance(self._sender, JaxTransferSender)
            self._sender.serve(plan.ranks.values(), plan.group)
            return self._sender
        key = (transport.host, transport.port, plan.group, plan.world_size)
        if self._sender is None or self._key != key:
            self.close()
            self._sender = make_co_sender(transport, self.process, plan.world_size)
            self._key = key
        return self._sender

    def close(self) -> None:
        """Leave the data-plane group (if in one)."""
        if self._sender is not None:
            self._sender.close()
        self._sender, self._key = None, None
