"""A follower trainer process's sends (`trainer.publish.co_sender.FollowerSends`), with process
0's gloo sender and one receiver in threads on loopback: it keeps its group across versions of
one plan generation, logs each send, and a plan it cannot serve (blocks of another version)
fails the attempt at once for everyone (no collective timeout), without raising."""

import json
import time

import numpy as np
import torch

from tests.unit.transport.gloo_group import run_in_threads
from trainer.publish.co_sender import FollowerSends
from trainer.publish.local_shards import LocalBlocks
from transport.base import TransferError
from transport.config import GlooTransportConfig
from transport.factory import make_receiver, make_sender
from transport.fan_in import boxes_of
from transport.manifest import Manifest
from transport.sync_plan import SyncPlan

W = {"a.weight": np.arange(48, dtype=np.float32).reshape(8, 6), "b.weight": np.ones(5, np.float32)}
SOURCES = {
    "a.weight": ((0, ((0, 4), (0, 6))), (1, ((4, 8), (0, 6)))),
    "b.weight": ((1, ((0, 5),)),),
}


def _manifest(version: int) -> Manifest:
    m = Manifest.of(version, [(k, v.shape) for k, v in W.items()], "float32", 1 << 20)
    sources = tuple(SOURCES[t.name] for t in m.tensors)
    return Manifest(version, m.tensors, m.bucket_bytes, senders=2, sources=sources)


def _blocks(m: Manifest, sender: int, version: int | None = None) -> LocalBlocks:
    out = LocalBlocks(m.version if version is None else version, dict(SOURCES))
    for i, t in enumerate(m.tensors):
        out.mine[t.name] = [W[t.name][r] for r in boxes_of(m, i, sender)]
    return out


def _collect(receiver, manifest):
    got = {}
    receiver.receive(manifest, lambda bucket: got.update({n: t.clone() for n, t in bucket}))
    return got


def test_follower_sends_two_versions_on_one_group_and_logs_them(tmp_path):
    cfg = GlooTransportConfig(port=0, timeout_s=20.0)
    lead = make_sender(cfg, num_receivers=1, senders=2)
    cfg = cfg.model_copy(update={"port": lead.port})
    receiver = make_receiver(cfg, rank=2, world_size=3)
    follower = FollowerSends("llama", None, "float32", 1, tmp_path / "sends.jsonl")
    try:
        for version in (1, 2):
            m = _manifest(version)
            plan = SyncPlan(cfg.model_dump(), m, {"e-1": 2}, 3, group=1)
            follower.blocks = _blocks(m, 1)
            lead_items = _blocks(m, 0).mine.items()
            res = run_in_threads([
                lambda m=m, it=lead_items: lead.send(m, iter(it)),
                lambda plan=plan, v=version: follower.send(plan.to_params(), v),
                lambda m=m: _collect(receiver, m),
            ])  # fmt: skip
            assert res[1] is True, res
            for name, want in W.items():
                torch.testing.assert_close(res[2][name], torch.from_numpy(want), rtol=0, atol=0)
            assert res[0].num_bytes == 4 * 24  # rows 0-3 of a.weight
        kept = follower._sender
        assert kept is not None  # the same group served both versions
    finally:
        follower.close()
        lead.close()
    rows = [json.loads(x) for x in (tmp_path / "sends.jsonl").read_text().splitlines()]
    assert [(r["version"], r["ok"], r["num_bytes"], r["group"]) for r in rows] == [
        (1, True, 4 * 24 + 4 * 5, 1), (2, True, 4 * 24 + 4 * 5, 1),
    ]  # fmt: skip


def test_blocks_of_another_version_fail_the_attempt_at_once(tmp_path):
    cfg = GlooTransportConfig(port=0, timeout_s=60.0)
    lead = make_sender(cfg, num_receivers=1, senders=2)
    cfg = cfg.model_copy(update={"port": lead.port})
    receiver = make_receiver(cfg, rank=2, world_size=3)
    follower = FollowerSends("llama", None, "float32", 1, tmp_path / "sends.jsonl")
    m = _manifest(3)
    follower.blocks = _blocks(m, 1, version=2)  # it still holds version 2
    plan = SyncPlan(cfg.model_dump(), m, {"e-1": 2}, 3, group=4)
    t0 = time.monotonic()
    try:
        res = run_in_threads([
            lambda: lead.send(m, iter(_blocks(m, 0).mine.items())),
            lambda: follower.send(plan.to_params(), 3),
            lambda: _collect(receiver, m),
        ])  # fmt: skip
    finally:
        follower.close()
        lead.close()
    took = time.monotonic() - t0
    assert res[1] is False
    assert isinstance(res[0], TransferError) and isinstance(res[2], TransferError), res
    assert took < 30, took  # the group broke at once, not at the 60 s collective timeout
    (row,) = [json.loads(x) for x in (tmp_path / "sends.jsonl").read_text().splitlines()]
    assert row["ok"] is False and "asked to send version 3, holding 2" in row["error"]
    assert follower._sender is None


def test_a_plan_of_the_file_data_plane_is_refused_without_a_group(tmp_path):
    follower = FollowerSends("llama", None, "float32", 1, None)
    m = _manifest(1)
    transport = {"kind": "file", "root": str(tmp_path)}
    assert follower.send(SyncPlan(transport, m, {"e-1": 2}, 3).to_params(), 1) is False
    assert follower.send({"transport": "{"}, 1) is False  # malformed plan params
