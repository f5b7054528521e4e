"""Far engines fed by compressed deltas over rate-limited links (issue 26 item 5), through
`benchmarks/far_engines.py` at its smallest size: a tiny Llama trained 3 steps on host
``trainer`` of a cluster in a box, two far engines (processes on hosts behind 100 and 20
Mbit/s, ``tc tbf``) pulling each version over the delta stream, then the same on unlimited
links and the trainer alone; and its ``--generate`` mode, the smoke main job with JAX engines
that generate behind those links. Real namespaces, processes and sockets; run under the heavy
lock.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.local.cluster_box import PREFIX, ClusterBoxError, check_support, remove_stale

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def test_two_far_engines_at_two_rates_are_served_deltas_with_bounded_lag():
    """Every engine loads version 0 (a keyframe) and the last version; the deltas are smaller
    than the keyframes (a tenth of the bf16 bytes or less); no version is refused; each lag
    stays within the versions a run makes; the trainer never waits on a link (its hand-over is
    a small part of its step); every namespace of the run is gone afterwards."""
    result = _run_far_engines(("ip", "unshare", "tc"), ["--timeout-s", "120"], 600)
    full = result["full_bf16_bytes"]
    assert full == 1836288  # TINY in bf16: 918,144 params
    for rate in ("unlimited", "100", "20"):
        link = result["links"][rate]
        assert link["refused"] == 0
        assert 2 <= link["versions_loaded"] <= STEPS + 1  # version 0 and the last, at least
        assert link["versions_loaded"] + link["versions_skipped"] == STEPS + 1
        assert link["keyframe_bytes"] < full  # a keyframe compresses
        assert link["delta_bytes"] is not None and link["delta_bytes"] < 0.25 * full
        assert link["delta_bytes"] < 0.25 * link["keyframe_bytes"]
        assert sum(link["lag"].values()) == STEPS and 1 <= link["lag_max"] <= STEPS
    for run in ("far", "unlimited", "no_far"):
        assert 0 <= result["runs"][run]["idle_fraction"] < 1


def test_the_main_job_with_generating_far_engines_serves_every_version_over_deltas():
    """`far_engines.py --generate`: the smoke main job on the cluster in a box, JAX engines
    behind unlimited, 100 and 20 Mbit/s links (delta stream), then the near engine alone:
    every engine loads every version (one keyframe, then a delta per version, each smaller
    than the keyframe, which is smaller than the bf16 payload), none is skipped at this size,
    each engine is one version behind at each publication (the push is synchronous), and
    every namespace of the run is gone afterwards."""
    result = _run_far_engines(
        ("ip", "unshare", "tc", "nft", "ss"), ["--generate", "--timeout-s", "300"], 900
    )
    for rate in ("unlimited", "100", "20"):
        link = result["links"][rate]
        assert (link["keyframes"], link["deltas"]) == (1, STEPS - 1), link
        assert link["full_bf16_bytes"] == 427264  # tiny:smollm2 in bf16
        assert link["delta_bytes"] < link["keyframe_bytes"] < link["full_bf16_bytes"], link
        assert link["versions_skipped"] == [] and link["lag"] == {"1": STEPS - 1}, link
    assert result["step_s"]["far"] > 0 and result["step_s"]["near_only"] > 0


def _run_far_engines(tools: tuple[str, ...], args: list[str], timeout_s: float) -> dict:
    """Run `benchmarks/far_engines.py --model tiny --steps STEPS ARGS` (the cluster in a box
    needs `tools`: a host without them fails the test, never skips it); assert it exits 0 and
    leaves none of its namespaces; return its last line's JSON object."""
    try:
        check_support(tools)
    except ClusterBoxError as err:
        pytest.fail(f"the cluster in a box cannot run here: {err}")
    argv = [sys.executable, str(REPO / "benchmarks" / "far_engines.py"), "--model", "tiny",
            "--steps", str(STEPS), *args]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            remove_stale()
    assert proc.returncode == 0, out[-4000:]
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{PREFIX}-p{proc.pid}-" not in leftovers
    return json.loads(out.strip().splitlines()[-1])
