"""Manifest: bucket partition, byte layout, JSON round trip and the fit check."""

import subprocess
import sys

import pytest

from transport.manifest import (
    ALIGN,
    Manifest,
    ManifestError,
    TensorSpec,
    bucket_layout,
    check_manifest,
)


def _m(bucket_bytes: int = 100) -> Manifest:
    # sizes in bytes: 40, 40, 200 (alone: larger than a bucket), 6, 8
    return Manifest(
        3,
        (
            TensorSpec("a", (10,), "float32"),
            TensorSpec("b", (2, 5), "float32"),
            TensorSpec("c", (50,), "float32"),
            TensorSpec("d", (3,), "bfloat16"),
            TensorSpec("e", (2,), "float32"),
        ),
        bucket_bytes,
    )


def test_buckets_are_greedy_and_big_tensors_travel_alone():
    m = _m(100)
    assert m.total_bytes == 40 + 40 + 200 + 6 + 8
    assert m.buckets() == [[0, 1], [2], [3, 4]]
    assert _m(1).buckets() == [[0], [1], [2], [3], [4]]
    assert _m(10**6).buckets() == [[0, 1, 2, 3, 4]]


def test_layout_aligns_every_tensor():
    m = _m(100)
    offsets, total = bucket_layout(m, [3, 4])
    assert offsets == [0, ALIGN] and total == 2 * ALIGN
    offsets, total = bucket_layout(m, [0, 1])
    assert offsets == [0, 48] and total == 96


def test_json_round_trip_is_canonical():
    m = _m()
    assert Manifest.from_json(m.to_json()) == m
    assert Manifest.from_dict(m.to_dict()).to_json() == m.to_json()
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.from_dict({"version": 1})


def test_bad_manifests_are_refused():
    with pytest.raises(ManifestError, match="repeated"):
        Manifest(0, (TensorSpec("a", (1,), "float32"), TensorSpec("a", (2,), "float32")), 8)
    with pytest.raises(ManifestError, match="dtype"):
        TensorSpec("a", (1,), "float8")
    with pytest.raises(ManifestError, match="version"):
        Manifest(-1, (), 8)
    with pytest.raises(ManifestError, match="bucket_bytes"):
        Manifest(0, (), 0)


def test_check_lists_every_problem():
    m = _m()
    expected = {t.name: (t.shape, t.dtype) for t in m.tensors}
    check_manifest(m, expected)
    expected.pop("e")
    expected["z"] = ((1,), "float32")
    expected["a"] = ((11,), "float32")
    expected["b"] = ((2, 5), "bfloat16")
    with pytest.raises(ManifestError) as err:
        check_manifest(m, expected)
    msg = str(err.value)
    assert "unknown names ['e']" in msg
    assert "missing names ['z']" in msg
    assert "a: shape [10], expected [11]" in msg
    assert "b: dtype float32, expected bfloat16" in msg


def test_sharded_manifest_round_trips_and_is_checked():
    base = Manifest.of(4, [("q", (64, 16)), ("k", (16, 16)), ("norm", (16,))], "bfloat16", 1024)
    m = base.sharded_for(2, {"q": "column", "k": "kv"}, num_kv_heads=1)
    assert m.sharded and [t.shard for t in m.tensors] == ["column", "kv", "replicated"]
    assert Manifest.from_json(m.to_json()) == m and m.to_json() != base.to_json()
    assert m.region(0, 1) == (slice(32, 64), slice(0, 16))
    assert m.region(1, 1) == (slice(0, 16), slice(0, 16))  # one KV head: both ranks hold it
    assert base.region(0, 1) == (slice(0, 64), slice(0, 16))
    expected = {t.name: (t.shape, t.dtype) for t in m.tensors}
    check_manifest(m, expected, tp_size=2)
    with pytest.raises(ManifestError, match="sharded for tp_size 2, the engine runs 4"):
        check_manifest(m, expected, tp_size=4)
    check_manifest(base, expected, tp_size=4)  # whole tensors fit any TP degree
    check_manifest(m, expected, tp_size=2, num_kv_heads=1)
    with pytest.raises(ManifestError, match="KV tensors split by 1 KV heads, the model has 2"):
        check_manifest(m, expected, tp_size=2, num_kv_heads=2)
    with pytest.raises(ManifestError, match=r"'q' \[64, 16\] cannot be split 'column' over"):
        base.sharded_for(3, {"q": "column"})
    with pytest.raises(ManifestError, match=r"shard kinds for tensors the manifest lacks: \['x'\]"):
        base.sharded_for(2, {"x": "row"})
    with pytest.raises(ManifestError, match="shard 'diagonal' is not one of"):
        TensorSpec("a", (4,), "float32", "diagonal")  # type: ignore[arg-type]


def test_transport_modules_import_without_torch():
    code = (
        "import sys, transport.factory, transport.gloo, transport.file, "
        "transport.nccl, transport.reshard, transport.delta_stream, transport.delta_receiver, "
        "transport.file_delta; "
        "bad = [m for m in ('torch', 'jax', 'vllm') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fingerprint_stands_for_the_whole_manifest():
    """The data plane offers only the 72-byte fingerprint (the manifest came with the sync
    plan): any difference in a tensor's name, shape, dtype or shard kind changes it, and the
    refusal says what differs."""
    import dataclasses
    import struct

    m = _m()
    fp = m.fingerprint()
    assert len(fp) == 72 and struct.unpack("<5q", fp[:40]) == (3, 5, 100, 1, 0)
    m.check_offered(fp)  # its own: no error
    assert Manifest.from_json(m.to_json()).fingerprint() == fp
    tensors = list(m.tensors)
    tensors[3] = TensorSpec("d", (3,), "float16")  # same size, other dtype
    other = dataclasses.replace(m, tensors=tuple(tensors))
    with pytest.raises(ManifestError) as e:
        m.check_offered(other.fingerprint())
    assert str(e.value) == (
        "offered manifest (version 3, 5 tensors, bucket 100 B, tp_size 1, other tensor "
        "names/shapes/dtypes/shards) differs from the expected one (version 3, 5 tensors, "
        "bucket 100 B, tp_size 1)"
    )
    with pytest.raises(ManifestError, match=r"version 4, 5 tensors, bucket 100 B"):
        m.check_offered(dataclasses.replace(m, version=4).fingerprint())
    with pytest.raises(ManifestError, match=r"offered manifest \(7 bytes, not a manifest"):
        m.check_offered(b"garbage")
