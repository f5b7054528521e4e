"""Receive buffers: reused across buckets and versions, never while a loader holds a view."""

import torch

from tests.unit.transport.gloo_group import gloo_group, run_in_threads
from transport.manifest import Manifest, bucket_layout
from transport.recv_buffers import ReceiveBuffers, held_elsewhere


def test_a_buffer_is_reused_only_when_no_view_of_it_is_alive():
    pool = ReceiveBuffers()
    a = pool.get("x", 100)
    ptr = a.data_ptr()
    assert held_elsewhere(pool._buffers["x"])  # `a` is a view of it
    del a
    assert not held_elsewhere(pool._buffers["x"])
    b = pool.get("x", 64)
    assert b.data_ptr() == ptr and (pool.reused, pool.allocated) == (1, 1)
    kept = b[:8].view(torch.int16)  # a loader keeps a view: the slot gets a fresh buffer
    kept.fill_(7)
    del b
    c = pool.get("x", 64)
    assert c.data_ptr() != ptr and (pool.reused, pool.allocated) == (1, 2)
    c.fill_(0)
    assert kept.tolist() == [7] * 4  # the held bytes are left as they were
    assert pool.get("y", 10).numel() == 10 and pool.nbytes == 64 + 10
    pool.clear()
    assert pool.nbytes == 0


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(32, 16, generator=g) for i in range(5)}


def test_a_receiver_reuses_its_slots_across_versions_and_keeps_held_views_intact():
    sender, (receiver,) = gloo_group(1)
    run_in_threads([sender.connect, receiver.connect])
    try:
        held: list[tuple[str, torch.Tensor]] = []
        ptrs: list[list[int]] = []
        for version in (1, 2, 3):
            w = _weights(version)
            m = Manifest.of(version, [(k, tuple(v.shape)) for k, v in w.items()], "float32",
                            32 * 16 * 4)  # fmt: skip
            assert len(m.buckets()) == 5
            seen: list[int] = []
            got: dict[str, torch.Tensor] = {}

            def on_bucket(bucket, seen=seen, got=got, version=version):
                seen.append(bucket[0][1].data_ptr())
                got.update((n, t.clone()) for n, t in bucket)
                if version == 2 and bucket[0][0] == "w0":
                    held.extend(bucket)  # a loader that keeps bucket 0's views

            res = run_in_threads(
                [lambda m=m, w=w: sender.send(m, w.items()),
                 lambda m=m, f=on_bucket: receiver.receive(m, f)]
            )  # fmt: skip
            assert not isinstance(res[0], BaseException), res[0]
            assert res[1] is None
            assert all(torch.equal(got[n], t) for n, t in w.items())
            ptrs.append(seen)
        sizes = {bucket_layout(m, b)[1] for b in m.buckets()}
        a, b = ptrs[0][:2]
        assert a != b and ptrs[0] == [a, b, a, b, a]  # two slots, reused in turn
        # version 2's loader kept bucket 0's views: from bucket 2 on, slot 0 is a fresh buffer
        c = ptrs[1][2]
        assert c not in (a, b) and ptrs[1] == [a, b, c, b, c] and ptrs[2] == [c, b, c, b, c]
        assert torch.equal(held[0][1], _weights(2)["w0"])  # the held bytes stayed version 2's
        pool = receiver._recv
        assert pool is not None and pool.nbytes == 2 * sizes.pop()
    finally:
        sender.close()
        receiver.close()
