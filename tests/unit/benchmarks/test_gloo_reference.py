"""`benchmarks/common.gloo_reference` against a real child process on loopback: the raw gloo
broadcast, the project's sender and the packing are measured on the same bytes, with the CPU
seconds that bound what a push can reach on this host."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

_BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def common():
    sys.path.insert(0, str(_BENCH))  # the spawned receiver imports `common` by name too
    try:
        import common as module

        yield module
    finally:
        sys.path.remove(str(_BENCH))


def test_gloo_reference_measures_the_wire_the_packing_and_the_hosts_ceiling(common):
    from transport.manifest import Manifest

    shapes = [("w", (512, 1024)), ("b", (1024,))]
    arrays = {n: np.random.default_rng(0).standard_normal(s, np.float32) for n, s in shapes}
    manifests = [Manifest.of(v, shapes, "bfloat16", 1 << 20) for v in (1, 2, 3)]
    ref = common.gloo_reference(manifests, lambda: [(n, arrays[n].T.T) for n, _ in shapes], 2)

    assert ref["host_cores"] == len(os.sched_getaffinity(0))
    for key in ("raw_gloo_gb_per_s", "transport_gb_per_s", "pack_gb_per_s",
                "raw_gloo_cpu_s_per_gb", "pack_cpu_s_per_gb"):  # fmt: skip
        assert np.isfinite(ref[key]) and ref[key] > 0, (key, ref)
    # CPU seconds of both ends over the rounds' wall seconds: some of a core, at most every core
    # (the peer's CPU is read while it waits between the rounds and its next step; the slack
    # is for the root's read of it after the last round's clock stopped)
    assert 0.05 < ref["raw_gloo_cores"] < ref["host_cores"] + 0.5, ref
    # the ceiling: raw wall time over the CPU time of wire and packing spread on every core
    raw_s_per_gb = ref["raw_gloo_cpu_s_per_gb"] / ref["raw_gloo_cores"]
    cpu_s_per_gb = ref["raw_gloo_cpu_s_per_gb"] + ref["pack_cpu_s_per_gb"]
    expected = raw_s_per_gb / max(raw_s_per_gb, cpu_s_per_gb / ref["host_cores"])
    assert ref["host_ceiling_over_raw_gloo"] == pytest.approx(expected, rel=1e-9)
    assert 0 < ref["host_ceiling_over_raw_gloo"] <= 1


def test_raw_rounds_and_timed_sends_alternate(common):
    """Raw round i, then send i: the two measured in turn under the same load, whatever the
    counts (the receiver follows the same list)."""
    assert common._rounds(3, 3) == [(True, 0), (True, 1), (True, 2)]
    assert common._rounds(3, 1) == [(True, 0), (True, None), (True, None)]
    assert common._rounds(1, 3) == [(True, 0), (False, 1), (False, 2)]
    assert common._rounds(0, 0) == []
