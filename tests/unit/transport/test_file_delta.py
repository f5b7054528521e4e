"""The file data plane's compressed deltas (`transport.file_delta`): every version arrives bit
for bit as its bf16 cast, whether the receiver holds the base, joins late or missed a push;
keyframes come every `full_every` versions and on a layout change; old versions go only when
nothing newer needs them; a corrupt file, a missing base or a failing load lets nothing in."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from transport.base import TransferError
from transport.config import FileTransportConfig
from transport.factory import make_receiver, make_sender
from transport.file import version_dir
from transport.file_delta import CHAIN, bucket_file, shuffle, unshuffle
from transport.manifest import Manifest, ManifestError

SHAPES = [("a", (64, 32)), ("b", (33,)), ("c", (16, 16))]  # b: odd size, padding after it


def _m(version: int, bucket_bytes: int = 4096, shapes=SHAPES) -> Manifest:
    return Manifest.of(version, shapes, "bfloat16", bucket_bytes)


def _versions(n: int, changed: float = 0.02, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """n fp32 weight sets, each a small step from the one before on a `changed` share of the
    values (as an optimizer step below bf16 resolution leaves most bf16 values alone)."""
    g = torch.Generator().manual_seed(seed)
    w = {n_: torch.randn(*s, generator=g) for n_, s in SHAPES}
    out = []
    for _ in range(n):
        out.append({k: v.clone() for k, v in w.items()})
        for v in w.values():
            mask = torch.rand(v.shape, generator=g) < changed
            v += mask * 0.05 * torch.randn(v.shape, generator=g)
    return out


def _cfg(tmp_path, **kw) -> FileTransportConfig:
    return FileTransportConfig(root=str(tmp_path), timeout_s=2, delta=True, **kw)


def _receive(receiver, manifest: Manifest) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    receiver.receive(manifest, lambda bucket: got.update({n: t.clone() for n, t in bucket}))
    return got


def _same_bits(got: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> bool:
    return all(
        torch.equal(got[k].view(torch.int16), v.to(torch.bfloat16).view(torch.int16))
        for k, v in sent.items()
    )


def _chain(tmp_path, v: int) -> dict:
    return json.loads((version_dir(tmp_path, v) / CHAIN).read_text())


def test_each_version_arrives_bit_for_bit_with_keyframes_every_full_every(tmp_path):
    cfg = _cfg(tmp_path, keep=10, full_every=3)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    weights = _versions(7)
    stats = []
    for v, w in enumerate(weights, start=1):
        stats.append(sender.send(_m(v), w.items()))
        assert _same_bits(_receive(receiver, _m(v)), w), v
    assert [_chain(tmp_path, v)["base"] for v in range(1, 8)] == [None, 1, 2, None, 4, 5, None]
    assert [_chain(tmp_path, v)["keyframe"] for v in range(1, 8)] == [1, 1, 1, 4, 4, 4, 7]
    full = stats[0].num_bytes
    assert full == (64 * 32 + 33 + 16 * 16) * 2
    for s, base in zip(stats, [None, 1, 2, None, 4, 5, None], strict=True):
        assert s.wire_bytes is not None and s.wire_bytes == sum(
            _chain(tmp_path, s.version)["stored_bytes"]
        )
        if base is not None:  # 2% of the values changed: the delta is a small part of bf16
            assert s.wire_bytes < 0.25 * full, (s.version, s.wire_bytes, full)


def test_a_late_or_skipped_receiver_rebuilds_from_the_keyframe_on_disk(tmp_path):
    cfg = _cfg(tmp_path, keep=10, full_every=4)
    sender = make_sender(cfg)
    weights = _versions(6, seed=1)
    early = make_receiver(cfg)
    for v, w in enumerate(weights, start=1):
        sender.send(_m(v), w.items())
        if v == 2:
            assert _same_bits(_receive(early, _m(2)), w)
    # a new receiver at v3 (keyframe 1, deltas 2 and 3) and the early one, which missed v3
    assert _same_bits(_receive(make_receiver(cfg), _m(3)), weights[2])
    assert _same_bits(_receive(early, _m(3)), weights[2])
    assert _same_bits(_receive(make_receiver(cfg), _m(6)), weights[5])  # keyframe 5, delta 6


def test_old_versions_go_only_when_nothing_kept_needs_them(tmp_path):
    cfg = _cfg(tmp_path, keep=1, full_every=4)
    sender = make_sender(cfg)
    for v, w in enumerate(_versions(6, seed=2), start=1):
        sender.send(_m(v), w.items())
        on_disk = sorted(int(p.name[1:]) for p in tmp_path.iterdir())
        keyframe = 1 if v <= 4 else 5
        assert on_disk == list(range(keyframe, v + 1)), (v, on_disk)


def test_a_layout_change_writes_a_keyframe(tmp_path):
    cfg = _cfg(tmp_path, keep=10)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    weights = _versions(3, seed=3)
    sender.send(_m(1), weights[0].items())
    sender.send(_m(2, bucket_bytes=1 << 20), weights[1].items())  # one bucket now
    sender.send(_m(3, bucket_bytes=1 << 20), weights[2].items())
    assert [_chain(tmp_path, v)["base"] for v in (1, 2, 3)] == [None, None, 2]
    assert _same_bits(_receive(receiver, _m(3, bucket_bytes=1 << 20)), weights[2])


def test_a_corrupt_delta_loads_nothing_and_names_the_bucket(tmp_path):
    cfg = _cfg(tmp_path, keep=10)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    weights = _versions(3, seed=4)
    for v, w in enumerate(weights[:2], start=1):
        sender.send(_m(v), w.items())
    assert _same_bits(_receive(receiver, _m(1)), weights[0])
    path = version_dir(tmp_path, 2) / bucket_file(0)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    path.write_bytes(bytes(blob))
    loaded: list[str] = []
    with pytest.raises(TransferError, match="bucket 0 of version 2"):
        receiver.receive(_m(2), lambda bucket: loaded.extend(n for n, _ in bucket))
    assert loaded == []  # every bucket is checked before the first is loaded
    # a wrong base: the hash of the rebuilt bucket is not the sender's
    chain = _chain(tmp_path, 2)
    path.unlink()
    sender2 = make_sender(_cfg(tmp_path / "other", keep=10))
    sender2.send(_m(1), weights[0].items())
    sender2.send(_m(2), weights[2].items())  # a different step 2, against the same base
    (version_dir(tmp_path, 2) / bucket_file(0)).write_bytes(
        (version_dir(tmp_path / "other", 2) / bucket_file(0)).read_bytes()
    )
    assert _chain(tmp_path / "other", 2)["sha256"][0] != chain["sha256"][0]
    with pytest.raises(TransferError, match="wrong SHA-256"):
        receiver.receive(_m(2), lambda bucket: loaded.extend(n for n, _ in bucket))
    assert loaded == []


def test_a_pruned_base_and_a_wrong_manifest_are_clear_errors(tmp_path):
    cfg = _cfg(tmp_path, keep=1, full_every=10)
    sender = make_sender(cfg)
    weights = _versions(3, seed=5)
    for v, w in enumerate(weights, start=1):
        sender.send(_m(v), w.items())
    import shutil

    shutil.rmtree(version_dir(tmp_path, 1))  # the keyframe gone (by hand: the sender keeps it)
    with pytest.raises(TransferError, match=f"version 1: no readable {CHAIN}"):
        make_receiver(cfg).receive(_m(3), lambda bucket: None)
    with pytest.raises(ManifestError, match="differs"):
        make_receiver(cfg).receive(_m(3, shapes=SHAPES[:2]), lambda bucket: None)
    with pytest.raises(TransferError, match="not committed"):
        make_receiver(cfg).receive(_m(9), lambda bucket: None)


def test_a_chain_that_points_at_itself_or_forward_is_refused(tmp_path):
    cfg = _cfg(tmp_path, keep=10)
    sender = make_sender(cfg)
    for v, w in enumerate(_versions(2, seed=7), start=1):
        sender.send(_m(v), w.items())
    path = version_dir(tmp_path, 2) / CHAIN
    for base in (2, 3, "1", -1):
        chain = json.loads(path.read_text()) | {"base": base}
        path.write_text(json.dumps(chain))
        with pytest.raises(TransferError, match=f"names base {base!r}"):
            make_receiver(cfg).receive(_m(2), lambda bucket: None)


def test_a_failed_load_is_a_transfer_error_and_the_next_version_still_arrives(tmp_path):
    cfg = _cfg(tmp_path, keep=10)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    weights = _versions(3, seed=6)
    for v, w in enumerate(weights, start=1):
        sender.send(_m(v), w.items())
    assert _same_bits(_receive(receiver, _m(1)), weights[0])

    def failing(bucket) -> None:
        raise RuntimeError("engine out of memory")

    with pytest.raises(TransferError, match="loading version 2 failed.*out of memory"):
        receiver.receive(_m(2), failing)
    assert _same_bits(_receive(receiver, _m(3)), weights[2])  # rebuilt from disk


def test_shuffle_regroups_each_tensors_bytes_and_keeps_the_padding():
    buf = np.arange(20, dtype=np.uint8)
    planes = [(0, 6, 2), (8, 8, 4)]  # bytes 6..7 and 16..19: padding / other
    out = shuffle(buf, planes)
    assert out[:6].tolist() == [0, 2, 4, 1, 3, 5]
    assert out[8:16].tolist() == [8, 12, 9, 13, 10, 14, 11, 15]
    assert out[6:8].tolist() == [6, 7] and out[16:].tolist() == [16, 17, 18, 19]
    assert np.array_equal(unshuffle(out, planes), buf)


def test_config_ranges():
    with pytest.raises(ValueError, match="full_every"):
        FileTransportConfig(root="/tmp/x", delta=True, full_every=0)
    with pytest.raises(ValueError, match="zstd_level"):
        FileTransportConfig(root="/tmp/x", delta=True, zstd_level=23)
