"""File transport: a version appears only when committed, arrives exactly, old ones go."""

import threading
import time

import pytest
import torch

from transport.base import TransferError, iter_packed
from transport.config import FileTransportConfig
from transport.factory import make_receiver, make_sender
from transport.file import version_dir
from transport.manifest import Manifest, ManifestError


def _w(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)}


def _m(version, bucket_bytes=64):
    return Manifest.of(version, [("a", (8, 4)), ("b", (4,))], "bfloat16", bucket_bytes)


def test_round_trip_waits_for_commit_and_keeps_two(tmp_path):
    cfg = FileTransportConfig(root=str(tmp_path), timeout_s=10, keep=2)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    got: dict[str, torch.Tensor] = {}
    t = threading.Thread(target=lambda: receiver.receive(_m(1), lambda b: got.update(b)))
    t.start()
    time.sleep(0.3)
    assert not got  # nothing before the commit
    stats = sender.send(_m(1), _w(1).items())
    t.join(10)
    assert stats.num_buckets == 2 and stats.num_bytes == (32 + 4) * 2
    for n, x in _w(1).items():
        assert torch.equal(got[n], x.to(torch.bfloat16))
    sender.send(_m(2), _w(2).items())
    sender.send(_m(3), _w(3).items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v0000000002", "v0000000003"]
    assert version_dir(tmp_path, 3).joinpath("bucket_00001.safetensors").exists()


def test_errors(tmp_path):
    cfg = FileTransportConfig(root=str(tmp_path), timeout_s=0.2)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    with pytest.raises(TransferError, match="not committed"):
        receiver.receive(_m(1), lambda b: None)
    with pytest.raises(ManifestError, match="shape"):
        sender.send(_m(1), [("a", torch.zeros(8, 5)), ("b", torch.zeros(4))])
    assert list(tmp_path.iterdir()) == []  # nothing half-written stays
    sender.send(_m(1), _w(1).items())
    with pytest.raises(ManifestError, match="bucket 64 B.* differs .*bucket 1048576 B"):
        receiver.receive(_m(1, bucket_bytes=1 << 20), lambda b: None)


def test_packing_checks_names_and_counts():
    with pytest.raises(ManifestError, match="got 'b', manifest says 'a'"):
        list(iter_packed(_m(1), [("b", torch.zeros(4))]))
    with pytest.raises(ManifestError, match="ran out"):
        list(iter_packed(_m(1), [("a", torch.zeros(8, 4))]))
    extra = [("a", torch.zeros(8, 4)), ("b", torch.zeros(4)), ("c", torch.zeros(1))]
    with pytest.raises(ManifestError, match="more tensors"):
        list(iter_packed(_m(1), extra))
