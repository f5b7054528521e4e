"""Fan-in over gloo (`transport.fan_in`): two senders, each holding only some blocks of each
tensor, and two receivers (threads of one process, each end its own process group, on
loopback). Every receiver gets each tensor (or its TP rank's region) bit for bit, each
sender sends only its own blocks, and bad sources or blocks fail clearly."""

import math

import numpy as np
import pytest
import torch

from tests.unit.transport.gloo_group import run_in_threads
from transport.base import TransferError
from transport.config import GlooTransportConfig
from transport.factory import make_co_sender, make_receiver, make_sender
from transport.fan_in import boxes_of, message_layout, region_of, sent_bytes
from transport.manifest import Manifest, ManifestError


def _weights() -> dict[str, np.ndarray]:
    g = np.random.default_rng(7)
    return {
        "embed.weight": g.standard_normal((64, 16)).astype(np.float32),
        "q.weight": g.standard_normal((16, 24)).astype(np.float32),
        "o.weight": g.standard_normal((24, 16)).astype(np.float32),
        "norm.weight": g.standard_normal(16).astype(np.float32),
        "odd.weight": g.standard_normal((7, 5)).astype(np.float32),
    }


# Who holds what: rows split in two, columns split in two, a 2x2 grid over both senders,
# one sender holding all, and an uneven split (3 + 4 rows).
SOURCES = {
    "embed.weight": [(0, ((0, 32), (0, 16))), (1, ((32, 64), (0, 16)))],
    "q.weight": [(1, ((0, 16), (0, 12))), (0, ((0, 16), (12, 24)))],
    "o.weight": [
        (0, ((0, 12), (0, 8))),
        (1, ((0, 12), (8, 16))),
        (1, ((12, 24), (0, 8))),
        (0, ((12, 24), (8, 16))),
    ],  # fmt: skip
    "norm.weight": [],
    "odd.weight": [(1, ((0, 3), (0, 5))), (0, ((3, 7), (0, 5)))],
}
SHARDS = {"embed.weight": "column", "q.weight": "column", "o.weight": "row"}


def _manifest(w, version=1, bucket_bytes=1500, dtype="float32", tp_size=1) -> Manifest:
    m = Manifest.of(version, [(k, v.shape) for k, v in w.items()], dtype, bucket_bytes)
    if tp_size > 1:
        m = m.sharded_for(tp_size, SHARDS)
    sources = tuple(tuple(SOURCES[t.name]) for t in m.tensors)
    return Manifest(m.version, m.tensors, m.bucket_bytes, m.tp_size, m.num_kv_heads, 2, sources)


def _blocks(w, m: Manifest, sender: int):
    return [
        (t.name, [w[t.name][r] for r in boxes_of(m, i, sender)]) for i, t in enumerate(m.tensors)
    ]


def _group(num_receivers=2, timeout_s=20.0):
    cfg = GlooTransportConfig(port=0, timeout_s=timeout_s)
    lead = make_sender(cfg, num_receivers=num_receivers, senders=2)
    cfg = cfg.model_copy(update={"port": lead.port})
    world = 2 + num_receivers
    co = make_co_sender(cfg, rank=1, world_size=world)
    receivers = [make_receiver(cfg, rank=g, world_size=world) for g in range(2, world)]
    return lead, co, receivers


def _collect(receiver, manifest):
    got: dict[str, torch.Tensor] = {}

    def on_bucket(bucket):
        for n, t in bucket:
            got[n] = t.clone()

    receiver.receive(manifest, on_bucket)
    return got


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_senders_deliver_every_tensor_exactly(tp_size, dtype):
    w = _weights()
    m = _manifest(w, dtype=dtype, tp_size=tp_size)
    assert len(m.buckets()) > 1
    lead, co, receivers = _group()
    res = run_in_threads(
        [lambda: lead.send(m, _blocks(w, m, 0)), lambda: co.send(m, _blocks(w, m, 1))]
        + [lambda r=r: _collect(r, m) for r in receivers]
    )
    assert not [x for x in res if isinstance(x, BaseException)], res
    s0, s1 = res[0], res[1]
    wire = getattr(torch, dtype)
    for g, got in zip(range(2), res[2:], strict=True):
        assert list(got) == list(w)
        for i, t in enumerate(m.tensors):
            want = torch.from_numpy(w[t.name]).to(wire)[m.region(i, g % tp_size)]
            torch.testing.assert_close(got[t.name], want, rtol=0, atol=0)
    # each sender sent its own blocks only: together every receiver's bytes exactly once
    ranks = [g % tp_size for g in range(2)]
    per_receiver = sum(
        math.prod(r.stop - r.start for r in m.region(i, tp)) * (4 if dtype == "float32" else 2)
        for i in range(len(m.tensors))
        for tp in ranks
    )  # fmt: skip
    assert s0.num_bytes == sent_bytes(m, 0, ranks) and s1.num_bytes == sent_bytes(m, 1, ranks)
    assert s0.num_bytes + s1.num_bytes == per_receiver
    assert 0.3 < s1.num_bytes / per_receiver < 0.7  # about half each
    assert s0.num_buckets == s1.num_buckets == len(m.buckets())


def test_manifest_round_trips_sources_and_checks_their_tiling():
    w = _weights()
    m = _manifest(w, tp_size=2)
    assert Manifest.from_json(m.to_json()) == m
    bad = dict(SOURCES, **{"odd.weight": [(1, ((0, 4), (0, 5))), (0, ((3, 7), (0, 5)))]})
    base = Manifest.of(1, [(k, v.shape) for k, v in w.items()], "float32", 1500)
    with pytest.raises(ManifestError, match=r"odd.weight.*do not tile it exactly once.*"
                       r"overlapping: True"):  # fmt: skip
        Manifest(1, base.tensors, 1500, 1, 0, 2, tuple(tuple(bad[t.name]) for t in base.tensors))
    short = dict(SOURCES, **{"odd.weight": [(1, ((0, 3), (0, 5)))]})
    with pytest.raises(ManifestError, match=r"15 of 35 elements"):
        Manifest(1, base.tensors, 1500, 1, 0, 2, tuple(tuple(short[t.name]) for t in base.tensors))
    with pytest.raises(ManifestError, match=r"from a sender in 0..1"):
        Manifest(1, base.tensors, 1500, 1, 0, 2,
                 tuple(((2, ((0, 64), (0, 16))),) if t.name == "embed.weight" else ()
                       for t in base.tensors))  # fmt: skip


def test_message_layout_parts_tile_each_region_once():
    w = _weights()
    m = _manifest(w, tp_size=2)
    for bucket in m.buckets():
        for tp in (0, 1):
            covered: dict[int, int] = {}
            for sender in (0, 1):
                for p in message_layout(m, bucket, sender, tp)[0]:
                    covered[p.tensor] = covered.get(p.tensor, 0) + math.prod(
                        s.stop - s.start for s in p.dst
                    )
            for i in bucket:
                assert covered[i] == math.prod(r.stop - r.start for r in m.region(i, tp))
    assert region_of(((1, 3), (0, 2))) == (slice(1, 3), slice(0, 2))


def test_a_sender_missing_a_block_fails_and_the_version_does_not_commit():
    w = _weights()
    m = _manifest(w)
    lead, co, receivers = _group(timeout_s=10.0)
    broken = [(n, b[:-1] if n == "o.weight" else b) for n, b in _blocks(w, m, 1)]
    res = run_in_threads(
        [lambda: lead.send(m, _blocks(w, m, 0)), lambda: co.send(m, broken)]
        + [lambda r=r: _collect(r, m) for r in receivers]
    )
    assert isinstance(res[1], ManifestError) and "o.weight" in str(res[1])
    assert "holds no block 1" in str(res[1])
    # the others see the group break (the co-sender left the collective), not a version
    for r in (res[0], *res[2:]):
        assert isinstance(r, TransferError), r


def test_receiver_refuses_sources_it_was_not_planned_with():
    w = _weights()
    m = _manifest(w)
    other = dict(SOURCES, **{"embed.weight": [(1, ((0, 32), (0, 16))), (0, ((32, 64), (0, 16)))]})
    theirs = Manifest(
        m.version, m.tensors, m.bucket_bytes, 1, 0, 2,
        tuple(tuple(other[t.name]) for t in m.tensors),
    )  # fmt: skip
    lead, co, receivers = _group()
    res = run_in_threads(
        [lambda: lead.send(m, _blocks(w, m, 0)), lambda: co.send(m, _blocks(w, m, 1)),
         lambda: _collect(receivers[0], m), lambda: _collect(receivers[1], theirs)]
    )  # fmt: skip
    assert isinstance(res[3], ManifestError) and "differs from the expected one" in str(res[3])
    for r in res[:3]:
        assert isinstance(r, TransferError) and "refused" in str(r), r
