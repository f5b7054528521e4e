"""gloo transport: a sender and two receivers (threads of one process, each with its own
process group) move versions exactly, refuse bad manifests and survive a failed load."""

import numpy as np
import pytest
import torch

from tests.unit.transport.gloo_group import gloo_group, run_in_threads
from transport.base import TransferError
from transport.config import GlooTransportConfig
from transport.factory import make_receiver, make_sender
from transport.manifest import Manifest, ManifestError


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=g),
        "layers.0.q.weight": torch.randn(16, 16, generator=g),
        "layers.0.norm.weight": torch.randn(16, generator=g),
        "head.weight": torch.randn(64, 16, generator=g, dtype=torch.float64),
    }


def _manifest(w, version, bucket_bytes, dtype="float32"):
    return Manifest.of(version, [(k, tuple(v.shape)) for k, v in w.items()], dtype, bucket_bytes)


@pytest.fixture()
def group():
    sender, receivers = gloo_group(2)
    run_in_threads([sender.connect] + [r.connect for r in receivers])
    return sender, receivers


def _collect(receiver, manifest, fail_at=None):
    got: dict[str, torch.Tensor] = {}
    buckets: list[list[str]] = []

    def on_bucket(bucket):
        buckets.append([n for n, _ in bucket])
        if fail_at is not None and len(buckets) == fail_at:
            raise ValueError("load failed on purpose")
        for n, t in bucket:
            got[n] = t.clone()

    receiver.receive(manifest, on_bucket)
    return got, buckets


def test_versions_arrive_exactly_with_any_bucket_size(group):
    sender, receivers = group
    for version, bucket_bytes, dtype in [(1, 64 * 16 * 4, "float32"), (2, 10**9, "bfloat16")]:
        w = _weights(version)
        m = _manifest(w, version, bucket_bytes, dtype)
        res = run_in_threads(
            [lambda w=w, m=m: sender.send(m, w.items())]
            + [lambda r=r, m=m: _collect(r, m) for r in receivers]
        )
        stats = res[0]
        assert stats.version == version and stats.num_bytes == m.total_bytes
        assert stats.num_buckets == len(m.buckets())
        for got, buckets in res[1:]:
            assert [n for b in buckets for n in b] == list(w)
            for n, t in w.items():
                assert got[n].dtype == getattr(torch, dtype)
                torch.testing.assert_close(got[n], t.to(got[n].dtype), rtol=0, atol=0)
    assert len(_manifest(_weights(1), 1, 64 * 16 * 4).buckets()) == 3


def test_numpy_jax_and_bf16_sources(group):
    import jax.numpy as jnp
    import ml_dtypes

    from transport.base import as_torch

    sender, receivers = group
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(5, dtype=np.float32).astype(ml_dtypes.bfloat16)
    c = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3) * 0.5
    d = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    assert as_torch(d).data_ptr() == d.unsafe_buffer_pointer()  # dlpack: no copy on CPU
    specs = [("a", (3, 4)), ("b", (5,)), ("c", (2, 3)), ("d", (8,))]
    m = Manifest.of(7, specs, "bfloat16", 1 << 20)
    res = run_in_threads(
        [lambda: sender.send(m, [("a", a), ("b", b), ("c", c), ("d", d)])]
        + [lambda r=r: _collect(r, m) for r in receivers]
    )
    got, _ = res[1]
    assert got["a"].float().numpy().tolist() == a.tolist()
    assert got["b"].float().numpy().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert got["c"].float().numpy().tolist() == [[0.0, 0.5, 1.0], [1.5, 2.0, 2.5]]
    ref = torch.linspace(-1.0, 1.0, 8).to(torch.bfloat16)
    assert torch.equal(got["d"], ref)


def test_mismatched_manifest_is_refused_before_any_tensor(group):
    sender, receivers = group
    w = _weights(3)
    m = _manifest(w, 3, 1 << 20)
    other = _manifest(w, 4, 1 << 20)
    res = run_in_threads(
        [lambda: sender.send(m, w.items()), lambda: _collect(receivers[0], m)]
        + [lambda: _collect(receivers[1], other)]
    )
    assert isinstance(res[0], TransferError) and "refused the manifest of version 3" in str(res[0])
    assert isinstance(res[2], ManifestError) and "version 3" in str(res[2])
    # receiver 0 accepted, but the vote said no: nothing was sent, and it is told so
    assert isinstance(res[1], TransferError) and "another receiver refused" in str(res[1])


def test_failed_load_aborts_commit_and_group_stays_usable(group):
    sender, receivers = group
    w = _weights(5)
    m = _manifest(w, 5, 64 * 16 * 4)
    res = run_in_threads(
        [lambda: sender.send(m, w.items()), lambda: _collect(receivers[0], m, fail_at=2)]
        + [lambda: _collect(receivers[1], m)]
    )
    assert isinstance(res[0], TransferError) and "failed to load version 5" in str(res[0])
    assert isinstance(res[1], TransferError) and "load failed on purpose" in str(res[1])
    assert isinstance(res[2], TransferError) and "another receiver" in str(res[2])
    # the next version goes through on the same group
    m6 = _manifest(w, 6, 1 << 20)
    res = run_in_threads(
        [lambda: sender.send(m6, w.items())] + [lambda r=r: _collect(r, m6) for r in receivers]
    )
    assert res[0].version == 6
    assert torch.equal(res[1][0]["embed.weight"], w["embed.weight"])


def test_sharded_failed_load_aborts_commit_and_group_stays_usable(group):
    """Two receivers as the TP ranks 0 and 1 of one engine, a sharded manifest: a failure in
    rank 1's loader fails the version everywhere; the next version arrives, rank by rank."""
    sender, receivers = group
    w = _weights(9)
    shards = {"embed.weight": "vocab", "layers.0.q.weight": "column", "head.weight": "vocab"}
    m = _manifest(w, 9, 64 * 16 * 4).sharded_for(2, shards)
    res = run_in_threads(
        [lambda: sender.send(m, w.items()), lambda: _collect(receivers[0], m)]
        + [lambda: _collect(receivers[1], m, fail_at=2)]
    )
    assert isinstance(res[0], TransferError) and "failed to load version 9" in str(res[0])
    assert isinstance(res[1], TransferError) and "another receiver" in str(res[1])
    assert isinstance(res[2], TransferError) and "load failed on purpose" in str(res[2])
    m10 = _manifest(w, 10, 1 << 20).sharded_for(2, shards)
    res = run_in_threads(
        [lambda: sender.send(m10, w.items())] + [lambda r=r: _collect(r, m10) for r in receivers]
    )
    assert res[0].version == 10
    (rank0, _), (rank1, _) = res[1], res[2]
    assert torch.equal(rank0["layers.0.q.weight"], w["layers.0.q.weight"][:8])
    assert torch.equal(rank1["layers.0.q.weight"], w["layers.0.q.weight"][8:])
    assert torch.equal(rank1["layers.0.norm.weight"], w["layers.0.norm.weight"])
    assert torch.equal(rank0["embed.weight"], w["embed.weight"][:32])  # vocab 64: 32 a rank
    assert torch.equal(rank1["head.weight"], w["head.weight"][32:].float())


def test_refuse_tells_the_sender(group):
    sender, receivers = group
    w = _weights(8)
    m = _manifest(w, 8, 1 << 20)
    res = run_in_threads(
        [lambda: sender.send(m, w.items()), lambda: receivers[0].refuse("unknown names ['x']")]
        + [lambda: _collect(receivers[1], m)]
    )
    assert isinstance(res[0], TransferError) and "refused" in str(res[0])
    assert isinstance(res[1], TransferError) and "unknown names ['x']" in str(res[1])


def test_receiver_times_out_without_a_sender():
    cfg = GlooTransportConfig(port=0, timeout_s=1)
    sender = make_sender(cfg, num_receivers=1)
    receiver = make_receiver(cfg.model_copy(update={"port": sender.port}), 1, 2)
    run_in_threads([sender.connect, receiver.connect])
    m = Manifest.of(1, [("a", (2,))], "float32", 64)
    with pytest.raises(TransferError, match="receiving version 1 failed"):
        receiver.receive(m, lambda b: None)


def test_sender_reuses_its_two_bucket_slots_across_buckets_and_pushes(group):
    from transport.base import BufferPool
    from transport.manifest import bucket_layout

    pool = BufferPool()
    a = pool.get("x", 100)
    assert pool.get("x", 60).data_ptr() == a.data_ptr() and pool.nbytes == 100
    assert pool.get("x", 300).numel() == 300 and pool.nbytes == 300  # grown, the old freed
    pool.clear()
    assert pool.nbytes == 0

    sender, receivers = group
    w = _weights(11)
    ptrs = []
    for version in (11, 12):
        m = _manifest(w, version, 64 * 16 * 4)
        res = run_in_threads(
            [lambda m=m: sender.send(m, w.items())]
            + [lambda r=r, m=m: _collect(r, m) for r in receivers]
        )
        assert res[0].num_buckets == 3
        for got, _ in res[1:]:
            assert all(torch.equal(got[n], t.float()) for n, t in w.items())
        ptrs.append([sender._pool.get(f"bucket@{k}", 1).data_ptr() for k in range(2)])
        sizes = [bucket_layout(m, b)[1] for b in m.buckets()]
        # PIPELINE_DEPTH = 2 slots: buckets 0 and 2 share slot 0, bucket 1 has slot 1; two
        # buckets held between pushes, not one per bucket
        assert sender._pool.nbytes == max(sizes[0], sizes[2]) + sizes[1]
    assert ptrs[0] == ptrs[1]


def test_both_ends_time_their_phases_within_the_send(group):
    sender, receivers = group
    w = _weights(7)
    m = _manifest(w, 7, 64 * 16 * 4)  # 3 buckets
    res = run_in_threads(
        [lambda: sender.send(m, w.items())] + [lambda r=r: _collect(r, m) for r in receivers]
    )
    stats = res[0]
    assert set(stats.phases) == {"offer_s", "pack_s", "wire_s", "commit_s"}
    assert min(stats.phases.values()) >= 0
    # the four phases tile the send: their sum is its seconds (up to float rounding)
    assert sum(stats.phases.values()) == pytest.approx(stats.seconds, abs=1e-6)
    for r in receivers:
        assert set(r.phases) == {"wait_s", "copy_s", "load_s", "commit_s"}
        assert min(r.phases.values()) >= 0
