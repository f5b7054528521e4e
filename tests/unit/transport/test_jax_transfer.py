"""The jax_transfer data plane (`transport.jax_transfer`): two sender processes (each with 2
CPU devices, its blocks spread over them) serve their blocks of a version; this process pulls
and assembles every tensor bit for bit. A manifest that differs from the one served is
refused, a version nobody serves times out, a dead sender is a clear error, and bad blocks
fail before anything is scheduled."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from transport.base import TransferError
from transport.fan_in import boxes_of
from transport.jax_transfer import JaxTransferReceiver, JaxTransferSender, pull_id
from transport.manifest import Manifest, ManifestError

REPO = Path(__file__).resolve().parents[3]
RECEIVER = 2  # group rank of the receiving engine (after the two senders)

# Who holds what: rows split, columns split, a 2x2 grid over both senders, one sender holding
# all, and an uneven split (3 + 4 rows).
SOURCES = {
    "embed.weight": [(0, ((0, 32), (0, 16))), (1, ((32, 64), (0, 16)))],
    "q.weight": [(1, ((0, 16), (0, 12))), (0, ((0, 16), (12, 24)))],
    "o.weight": [
        (0, ((0, 12), (0, 8))),
        (1, ((0, 12), (8, 16))),
        (1, ((12, 24), (0, 8))),
        (0, ((12, 24), (8, 16))),
    ],  # fmt: skip
    "norm.weight": [(1, ((0, 16),))],
    "odd.weight": [(1, ((0, 3), (0, 5))), (0, ((3, 7), (0, 5)))],
}


def weights() -> dict[str, np.ndarray]:
    g = np.random.default_rng(7)
    return {
        "embed.weight": g.standard_normal((64, 16)).astype(np.float32),
        "q.weight": g.standard_normal((16, 24)).astype(np.float32),
        "o.weight": g.standard_normal((24, 16)).astype(np.float32),
        "norm.weight": g.standard_normal(16).astype(np.float32),
        "odd.weight": g.standard_normal((7, 5)).astype(np.float32),
    }


def manifest(w: dict[str, np.ndarray], version: int, names: tuple[str, ...] = ()) -> Manifest:
    """The test's 2-sender manifest of `version`; `names` renames the tensors (another
    layout with the same shapes)."""
    keys = list(w)
    m = Manifest.of(version, [(k, w[k].shape) for k in keys], "float32", 1500)
    sources = tuple(tuple(SOURCES[k]) for k in keys)
    m = Manifest(m.version, m.tensors, m.bucket_bytes, 1, 0, 2, sources)
    if names:
        tensors = tuple(type(t)(n, t.shape, t.dtype) for t, n in zip(m.tensors, names, strict=True))
        m = Manifest(m.version, tensors, m.bucket_bytes, 1, 0, 2, sources)
    return m


def blocks(w: dict[str, np.ndarray], m: Manifest, sender: int) -> list:
    return [
        (t.name, [w[t.name][r] for r in boxes_of(m, i, sender)]) for i, t in enumerate(m.tensors)
    ]


@pytest.fixture(scope="module")
def senders():
    """Two sender processes; sender 0 serves versions 1, 2 and 4, sender 1 versions 1, 2
    (version 3 is served by nobody, 4 by sender 0 only)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.unit.transport.jax_transfer_sender", str(r), v],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r, v in ((0, "1,2,4"), (1, "1,2"))
    ]
    try:
        addresses = tuple(p.stdout.readline().strip() for p in procs)  # type: ignore[union-attr]
        assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
        yield procs, addresses
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_two_sender_processes_fan_in_bit_for_bit(senders):
    _, addresses = senders
    w = weights()
    receiver = JaxTransferReceiver(addresses, RECEIVER, 0, 30.0)
    got = receiver.pull(manifest(w, 1))
    assert list(got) == list(w)
    for name, x in got.items():
        assert x.sharding.device_set == {jax.local_devices()[0]}
        np.testing.assert_array_equal(np.asarray(x), w[name])
    # the torch-facing form hands the same tensors bucket by bucket (version 2: one pull per id)
    seen: dict[str, np.ndarray] = {}
    receiver.receive(manifest(w, 2), lambda b: seen.update((n, t.numpy().copy()) for n, t in b))
    assert list(seen) == list(w)
    for name, x in seen.items():
        np.testing.assert_array_equal(x, w[name])


def test_another_manifest_is_refused():
    """Same shapes, other names: the pull moves the bytes, the fingerprint check refuses them
    before any tensor is used."""
    w = weights()
    sender = JaxTransferSender("127.0.0.1", 30.0, 0, (RECEIVER,), 9)
    whole = Manifest.of(7, [(k, v.shape) for k, v in w.items()], "float32", 1500)
    sender.send(whole, iter(w.items()))
    renamed = Manifest.of(
        7, [(f"x{k}", v.shape) for k, v in enumerate(w.values())], "float32", 1500
    )
    assert renamed.fingerprint() != whole.fingerprint()
    receiver = JaxTransferReceiver((sender.address,), RECEIVER, 9, 30.0)
    with pytest.raises(TransferError, match="refused: sender 0 .* offered another manifest"):
        receiver.pull(renamed)


def test_a_version_nobody_serves_times_out(senders):
    _, addresses = senders
    receiver = JaxTransferReceiver(addresses, RECEIVER, 0, 1.5)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match=r"version 3 from sender 0 .* within 1.5 s"):
        receiver.pull(manifest(weights(), 3))
    assert time.monotonic() - t0 < 10


def test_a_dead_sender_is_a_clear_error(senders):
    """Version 4 is served by sender 0 only; sender 1 is killed: the pull fails within the
    timeout naming sender 1."""
    procs, addresses = senders
    procs[1].kill()
    procs[1].wait(10)
    receiver = JaxTransferReceiver(addresses, RECEIVER, 0, 3.0)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="sender 1"):
        receiver.pull(manifest(weights(), 4))
    assert time.monotonic() - t0 < 15


def test_one_sender_serves_whole_tensors_and_arrays_over_several_devices():
    """Without `sources` sender 0 serves every tensor whole; a numpy array and a JAX array
    are both placed on one device (cast to the wire dtype there)."""
    w = weights()
    m = Manifest.of(1, [(k, v.shape) for k, v in w.items()], "bfloat16", 1500)
    sender = JaxTransferSender("127.0.0.1", 30.0, 0, (1,), 3)
    items = [(k, jax.numpy.asarray(v) if i % 2 else v) for i, (k, v) in enumerate(w.items())]
    stats = sender.send(m, iter(items))
    assert stats.num_bytes == m.total_bytes
    got = JaxTransferReceiver((sender.address,), 1, 3, 30.0).pull(m)
    for name, x in got.items():
        assert x.dtype == jax.numpy.bfloat16
        want = jax.numpy.asarray(w[name]).astype(jax.numpy.bfloat16)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(want))


def test_bad_blocks_fail_before_anything_is_served():
    w = weights()
    m = manifest(w, 1)
    sender = JaxTransferSender("127.0.0.1", 30.0, 0, (2,), 0)
    good = blocks(w, m, 0)
    with pytest.raises(ManifestError, match="sender 0 holds 1 blocks, got 2"):
        sender.send(m, [(good[0][0], good[0][1] * 2), *good[1:]])
    with pytest.raises(ManifestError, match=r"embed.weight: block \[31, 16\]"):
        sender.send(m, [(good[0][0], [good[0][1][0][1:]]), *good[1:]])
    with pytest.raises(ManifestError, match="got 'q.weight', manifest says 'embed.weight'"):
        sender.send(m, good[1:])
    with pytest.raises(TransferError, match="no receivers"):
        JaxTransferSender("127.0.0.1", 30.0, 0).send(m, good)
    with pytest.raises(TransferError, match="names no sender"):
        JaxTransferReceiver((), 1)
    with pytest.raises(ManifestError, match="2 senders, the plan names 1"):
        JaxTransferReceiver(("127.0.0.1:1",), 2).pull(m)
    with pytest.raises(ManifestError, match="out of range"):
        pull_id(1, 0, 1 << 16)
    assert pull_id(3, 1, 2) == (3 << 32) | (1 << 16) | 2
