"""Shared-memory transport: a version appears only when committed, arrives exactly as views of
one mapping, and a segment that is stale, truncated, of another layout or missing is refused
before anything loads; a full tmpfs is a clear error with nothing left behind."""

import errno
import os
import threading
import time

import numpy as np
import pytest
import torch

from transport.base import TransferError
from transport.config import ShmTransportConfig
from transport.factory import make_receiver, make_sender
from transport.manifest import Manifest, ManifestError
from transport.shm import HEADER_BYTES, MAGIC, bucket_offsets, segment_path


def _w(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(8, 4, generator=g),
        "b": torch.randn(4, generator=g),
        "c": torch.randn(3, 5, generator=g).T,  # a strided (transposed) source
    }


def _m(version, bucket_bytes=64, dtype="bfloat16"):
    shapes = [("a", (8, 4)), ("b", (4,)), ("c", (5, 3))]
    return Manifest.of(version, shapes, dtype, bucket_bytes)


def _collect(receiver, manifest):
    got: dict[str, torch.Tensor] = {}
    calls = []

    def on_bucket(bucket):
        calls.append([n for n, _ in bucket])
        got.update({n: t.clone() for n, t in bucket})

    receiver.receive(manifest, on_bucket)
    return got, calls


@pytest.fixture
def cfg(tmp_path):
    return ShmTransportConfig(root=str(tmp_path / "shm"), timeout_s=5, keep=2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_round_trip_after_the_commit_in_bucket_order(cfg, dtype):
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    m = _m(1, dtype=dtype)
    out: list = []
    t = threading.Thread(target=lambda: out.append(_collect(receiver, m)))
    t.start()
    time.sleep(0.3)
    assert not out  # nothing before the commit
    stats = sender.send(m, _w(1).items())
    t.join(10)
    got, calls = out[0]
    # 64 B buckets: bf16 a (64 B) fills one, b and c (8 + 30 B) share one; fp32 needs three
    want = [["a"], ["b", "c"]] if dtype == "bfloat16" else [["a"], ["b"], ["c"]]
    assert calls == want and stats.num_buckets == len(m.buckets()) == len(want)
    for n, x in _w(1).items():
        assert torch.equal(got[n], x.to(getattr(torch, dtype)))
    # the segment is the header, then the buckets at their offsets
    seg = segment_path(cfg.root, 1)
    assert seg.stat().st_size == bucket_offsets(m)[1]
    assert seg.read_bytes()[:8] == MAGIC and bucket_offsets(m)[0][0][0] == HEADER_BYTES


def test_keeps_the_newest_and_close_unlinks_what_it_wrote(cfg):
    sender = make_sender(cfg)
    for v in (1, 2, 3):
        sender.send(_m(v), _w(v).items())
    assert sorted(os.listdir(cfg.root)) == ["v0000000002.seg", "v0000000003.seg"]
    sender.send(_m(3), _w(4).items())  # a re-send of the same version replaces it
    got, _ = _collect(make_receiver(cfg), _m(3))
    assert torch.equal(got["a"], _w(4)["a"].to(torch.bfloat16))
    sender.close()  # the segments, then the folder it left empty
    assert not os.path.exists(cfg.root)


def test_a_loader_that_writes_into_its_views_leaves_the_segment_as_sent(cfg):
    make_sender(cfg).send(_m(1), _w(1).items())

    def scribble(bucket):
        for _, t in bucket:
            t.fill_(7)

    make_receiver(cfg).receive(_m(1), scribble)  # copy-on-write pages: private to it
    got, _ = _collect(make_receiver(cfg), _m(1))
    assert torch.equal(got["b"], _w(1)["b"].to(torch.bfloat16))


def test_views_outlive_the_receive_and_the_unlink(cfg):
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    sender.send(_m(1), _w(1).items())
    kept = []
    receiver.receive(_m(1), kept.extend)  # views, as vLLM's layerwise reload may keep them
    sender.close()  # unlinked; the mapping stays while the views live
    assert not segment_path(cfg.root, 1).exists()
    assert torch.equal(dict(kept)["a"], _w(1)["a"].to(torch.bfloat16))


def test_not_committed_times_out(tmp_path):
    cfg = ShmTransportConfig(root=str(tmp_path), timeout_s=0.2)
    make_sender(cfg)
    with pytest.raises(TransferError, match="version 1 not committed within 0.2 s"):
        make_receiver(cfg).receive(_m(1), lambda b: None)


def test_a_stale_segment_is_refused_before_any_load(cfg):
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    sender.send(_m(1), _w(1).items())
    os.rename(segment_path(cfg.root, 1), segment_path(cfg.root, 2))  # v1's bytes named v2
    loads = []
    with pytest.raises(
        TransferError, match="stale segment: it holds version 1.*expected version 2"
    ):
        receiver.receive(_m(2), loads.append)
    assert loads == []


def test_another_layout_is_a_manifest_error(cfg):
    make_sender(cfg).send(_m(1), _w(1).items())
    other = Manifest.of(1, [("a", (8, 4)), ("b", (4,)), ("d", (5, 3))], "bfloat16", 64)
    with pytest.raises(ManifestError, match="v0000000001.seg"):
        make_receiver(cfg).receive(other, lambda b: None)


def test_a_truncated_segment_is_refused_before_any_load(cfg):
    make_sender(cfg).send(_m(1), _w(1).items())
    path = segment_path(cfg.root, 1)
    need = path.stat().st_size
    os.truncate(path, need - 16)
    loads = []
    with pytest.raises(
        TransferError, match=f"truncated: {need - 16} bytes, version 1 needs {need}"
    ):
        make_receiver(cfg).receive(_m(1), loads.append)
    assert loads == []


def test_not_a_segment_is_refused(cfg):
    make_sender(cfg).send(_m(1), _w(1).items())
    path = segment_path(cfg.root, 1)
    data = bytearray(path.read_bytes())
    data[:8] = b"SAFETENS"
    path.write_bytes(bytes(data))
    with pytest.raises(TransferError, match="not a segment of format 1"):
        make_receiver(cfg).receive(_m(1), lambda b: None)


def test_a_failed_load_is_a_transfer_error_and_the_next_version_arrives(cfg):
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    sender.send(_m(1), _w(1).items())

    def boom(bucket):
        raise RuntimeError("loader broke")

    with pytest.raises(TransferError, match="loading version 1 failed.*loader broke"):
        receiver.receive(_m(1), boom)
    sender.send(_m(2), _w(2).items())
    got, _ = _collect(receiver, _m(2))
    assert torch.equal(got["c"], _w(2)["c"].to(torch.bfloat16))


def test_a_wrong_tensor_commits_nothing_and_leaves_no_file(cfg):
    sender = make_sender(cfg)
    with pytest.raises(ManifestError, match="shape"):
        sender.send(_m(1), [("a", torch.zeros(8, 5)), ("b", torch.zeros(4))])
    with pytest.raises(ManifestError, match="ran out"):
        sender.send(_m(1), [("a", torch.zeros(8, 4))])
    assert os.listdir(cfg.root) == []


def test_no_room_is_a_clear_error_with_nothing_left(cfg, monkeypatch):
    sender = make_sender(cfg)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(TransferError, match=r"no room for version 1 in .*needs 0\.0 MiB"):
        sender.send(_m(1), _w(1).items())
    assert os.listdir(cfg.root) == []


def test_a_real_tmpfs_segment_from_numpy_bf16_and_fp32_views(tmp_path):
    """/dev/shm (the default place) where the machine has it; numpy sources as the publisher
    hands them (fp32 views cast while packed)."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    cfg = ShmTransportConfig(root=os.path.join(root, f"jaxrl-test-{os.getpid()}"), keep=1)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    rng = np.random.default_rng(0)
    w = {"a": rng.standard_normal((8, 4), np.float32), "b": rng.standard_normal(4, np.float32)}
    w["c"] = rng.standard_normal((3, 5), np.float32).T
    m = _m(5, bucket_bytes=1 << 20)
    try:
        sender.send(m, w.items())
        got, calls = _collect(receiver, m)
        assert calls == [["a", "b", "c"]]
        for n, x in w.items():
            assert torch.equal(got[n], torch.from_numpy(np.ascontiguousarray(x)).bfloat16())
    finally:
        sender.close()
    assert not os.path.exists(cfg.root)
