"""Sharded weight delivery: edge cases of the per-rank layout (an empty vocab
range, a bucket of replicated tensors only, several engines), reading regions out of
FSDP-sharded / data-parallel-replicated JAX arrays and bf16 sources, and the error a receiver
raises when the offered manifest differs from the expected one only in its TP sharding."""

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mappings.shards import tp_slice
from tests.unit.transport.gloo_group import gloo_group, run_in_threads
from transport.base import TransferError, write_region
from transport.manifest import Manifest, ManifestError


def _collect(receiver, manifest):
    got: dict[str, torch.Tensor] = {}

    def on_bucket(bucket):
        for name, t in bucket:
            got[name] = t.clone()

    receiver.receive(manifest, on_bucket)
    return got


def test_empty_vocab_range_and_replicated_only_bucket_over_two_engines():
    """Vocab 65 padded to 128 over TP 4: ranks hold 32, 32, 1 and 0 rows; the head travels
    alone (a bucket of one sharded tensor, one rank's buffer empty) and the norm alone (a bucket
    of replicated tensors only). Two engines of TP 4: group ranks 1..8, TP rank (g - 1) % 4."""
    g = torch.Generator().manual_seed(3)
    w = {
        "head": torch.randn(65, 4, generator=g),
        "norm": torch.randn(4, generator=g),
        "q": torch.randn(8, 4, generator=g),
    }
    base = Manifest.of(7, [(n, tuple(t.shape)) for n, t in w.items()], "float32", 160)
    m = base.sharded_for(4, {"head": "vocab", "q": "column"})
    assert [[m.tensors[i].name for i in b] for b in m.buckets()] == [["head"], ["norm", "q"]]
    assert [m.region(0, r)[0] for r in range(4)] == [
        slice(0, 32),
        slice(32, 64),
        slice(64, 65),
        slice(65, 65),
    ]
    sender, receivers = gloo_group(8)
    res = run_in_threads(
        [lambda: sender.send(m, w.items())] + [lambda r=r: _collect(r, m) for r in receivers]
    )
    assert res[0].version == 7 and res[0].num_buckets == 2
    for j, got in enumerate(res[1:]):
        rank = j % 4
        head_rows = m.region(0, rank)[0]
        assert torch.equal(got["head"], w["head"][head_rows]), j
        assert torch.equal(got["norm"], w["norm"]), j
        assert torch.equal(got["q"], w["q"][2 * rank : 2 * rank + 2]), j
    assert tuple(res[4]["head"].shape) == (0, 4) and tuple(res[8]["head"].shape) == (0, 4)
    sender.close()
    for r in receivers:
        r.close()


def test_receiver_names_the_tp_sharding_when_only_it_differs():
    """The receiver expects whole tensors, the sender offers the same version sharded for TP 2:
    the refusal must say what differs (the TP degree), not print two identical summaries."""
    w = {"q": torch.arange(32, dtype=torch.float32).reshape(8, 4)}
    whole = Manifest.of(3, [("q", (8, 4))], "float32", 1024)
    sharded = whole.sharded_for(2, {"q": "column"})
    sender, (receiver,) = gloo_group(1)
    res = run_in_threads(
        [lambda: sender.send(sharded, w.items()), lambda: _collect(receiver, whole)]
    )
    assert isinstance(res[0], TransferError) and "refused the manifest of version 3" in str(res[0])
    assert isinstance(res[1], ManifestError)
    assert "tp_size 2" in str(res[1]) and "tp_size 1" in str(res[1]), str(res[1])
    sender.close()
    receiver.close()


@pytest.mark.parametrize("spec", [P("fsdp", None), P(None, "fsdp"), P(("dp", "fsdp"), None)])
@pytest.mark.parametrize("kind", ["vocab", "column", "row", "kv"])
def test_write_region_reads_only_the_overlapping_shards(spec, kind):
    """A [200, 16] float32 array on a 2 (dp, replicas) x 4 (fsdp) mesh split along dim 0, dim 1
    or both axes: every TP rank's region of TP 1, 2, 4 and 8 (vocab 200 padded to 256: TP 8's
    last rank is empty; kv with 2 heads: replicated past TP 2) comes out exactly, cast to bf16
    as torch rounds."""
    full = (np.arange(200 * 16, dtype=np.float32).reshape(200, 16) - 1600.0) / 7.0
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "fsdp"))
    a = jax.device_put(full, NamedSharding(mesh, spec))
    assert not a.is_fully_replicated and len(a.addressable_shards) == 8
    for tp in (1, 2, 4, 8):
        for r in range(tp):
            if kind == "row" and 16 % tp:
                continue
            region = tp_slice(full.shape, kind, tp, r, num_kv_heads=2)
            dst = torch.full([s.stop - s.start for s in region], 7.0, dtype=torch.bfloat16)
            write_region(dst, a, region)
            want = torch.from_numpy(np.ascontiguousarray(full[region])).to(torch.bfloat16)
            assert torch.equal(dst, want), (spec, kind, tp, r)
    last = tp_slice(full.shape, "vocab", 8, 7)
    assert last[0] == slice(200, 200)


def test_write_region_casts_bf16_sources_and_keeps_strides():
    """numpy (ml_dtypes) bf16 transposed / reversed views and JAX bf16 arrays, whole or split,
    land exactly in float32 and bf16 destinations; zero-size tensors too."""
    full = (np.arange(64 * 12, dtype=np.float32).reshape(64, 12) - 300.0) / 3.0
    b16 = full.astype(ml_dtypes.bfloat16)
    as_f32 = b16.astype(np.float32)
    region = tp_slice((12, 64), "row", 2, 1)  # columns 32..64 of the transposed view
    dst = torch.empty(12, 32, dtype=torch.float32)
    write_region(dst, b16.T, region)
    assert torch.equal(dst, torch.from_numpy(np.ascontiguousarray(as_f32.T[region])))
    dst = torch.empty(64, 12, dtype=torch.float32)
    write_region(dst, b16[::-1], (slice(0, 64), slice(0, 12)))
    assert torch.equal(dst, torch.from_numpy(np.ascontiguousarray(as_f32[::-1])))
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    for arr in (jax.numpy.asarray(b16), jax.device_put(b16, NamedSharding(mesh, P(None, "fsdp")))):
        dst = torch.empty(32, 12, dtype=torch.bfloat16)
        write_region(dst, arr, tp_slice((64, 12), "column", 2, 1))
        assert torch.equal(dst.float(), torch.from_numpy(as_f32[32:]))
    empty = jax.device_put(np.zeros((0, 8), np.float32), NamedSharding(mesh, P(None, "fsdp")))
    dst = torch.empty(0, 4)
    write_region(dst, empty, (slice(0, 0), slice(4, 8)))
    assert tuple(dst.shape) == (0, 4)


def test_manifest_and_sync_plan_stay_free_of_numpy_at_import():
    """manifest.py and sync_plan.py promise "no torch, numpy or JAX at import time"; the
    manifest now imports `reshard` for `tp_slice`, which must not pull numpy in."""
    import subprocess
    import sys

    code = (
        "import sys, transport.manifest, transport.reshard, transport.sync_plan; "
        "bad = [m for m in ('numpy', 'torch', 'jax') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
