"""Near and far engines in one job, and the far link cut while a version is on it (issue 26
item 5; docs/clusters.md "Near and far engines").

One run of the smoke job (JAX engines, tiny model) on a cluster in a box: the gateway and the
trainer on host ``trainer``, engine 0 on ``near`` fed over gloo (the run's data plane), engine 1
on ``far`` (its link at 20 Mbit/s, ``tc tbf``) fed over the delta stream
(``launch.far_engines=[1]``), in one sync plan and one weight version sequence. After a few
steps the far host's link is cut right after a version is published (the far engine is
pulling it), for `CUT_S` seconds or until the trainer went ``MAX_LAG + 2`` steps on, at most
`CUT_MAX_S` (below the gateway's heartbeat timeout: nobody is dropped);
the trainer and the near engine go on; when the link is back the far engine finishes its pull,
takes the newest version as a delta and serves again. The trainer is then stopped with SIGINT
(a graceful stop after the update under way). The module fixture runs the job once; each test
asserts one side of it. Real namespaces, processes and sockets; run under the helpers' lock.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from deploy.local.cluster_box import PREFIX, ClusterBox, ClusterBoxError, check_support
from deploy.local.hosts_job import MainJobOnHosts
from tests.integration.smoke_job import assert_no_group_lost, jsonl_rows

pytestmark = pytest.mark.slow
MAX_LAG = 2
CUT_S = 8.0  # the far link's shortest outage
CUT_MAX_S = 20.0  # its longest: below launch.engine_heartbeat_timeout_s (30)
FAR_MBIT = 20.0


@dataclass
class Run:
    """What the fixture's run left: the job (stopped), its records and the cut's times."""

    job: MainJobOnHosts
    summary: dict
    metrics: list[dict]
    groups: list[dict]
    events: list[dict]
    cut_version: int  # published right before the cut: on the far link when it went down
    t_cut: float
    t_back: float
    steps_at_cut: int
    steps_at_back: int
    code: int | None
    namespaces_left: list[str]


def _wait(job: MainJobOnHosts, what: str, check, timeout_s: float):  # noqa: ANN001
    """Poll `check()` until it answers something truthy; the processes must stay alive."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        job.check_alive()
        if job.procs["trainer0"].poll() is not None:
            raise AssertionError(f"the trainer exited early:\n{job.log('trainer0')[-3000:]}")
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


def _rows(job: MainJobOnHosts, name: str) -> list[dict]:
    path = job.run_dir / name
    return jsonl_rows(path) if path.exists() else []


def _far_loaded(job: MainJobOnHosts, at_least: int) -> bool:
    return any(
        e["event"] == "loaded" and e["engine"].startswith("engine1-far")
        and e["version"] >= at_least for e in job.events()
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    try:
        check_support(("ip", "unshare", "nft", "tc", "ss"))
    except ClusterBoxError as err:
        pytest.fail(f"the cluster in a box cannot run here: {err}")
    tmp = tmp_path_factory.mktemp("nearfar")
    box = ClusterBox(["trainer", "near", "far"])
    job = MainJobOnHosts(
        box, tmp / "run", tmp / "cache", trainer_hosts=["trainer"], engine_hosts=["near", "far"],
        overrides=["trainer.steps=400", "eval.size=0", "trainer.checkpoint_every=0",
                   "launch.data_plane=gloo", "launch.far_engines=[1]",
                   f"rollout.max_lag={MAX_LAG}", "launch.data_plane_timeout_s=60",
                   "launch.engine_heartbeat_timeout_s=30"],
    )  # fmt: skip
    try:
        box.up()
        box.limit_rate("far", FAR_MBIT)
        job.start()
        _wait(job, "3 steps and a delta loaded by the far engine", lambda: (
            len(_rows(job, "metrics.jsonl")) >= 3 and _far_loaded(job, 2)), 400)  # fmt: skip
        seen = len(job.events())
        published = _wait(job, "a publication", lambda: next(
            (e for e in job.events()[seen:] if e["event"] == "published"), None), 60)  # fmt: skip
        box.set_link("far", False)
        t_cut, steps_at_cut = time.time(), len(_rows(job, "metrics.jsonl"))
        time.sleep(CUT_S)
        # the outage lasts until the trainer went MAX_LAG + 2 steps on (or CUT_MAX_S): a
        # slow host's steps then still show the far engine held back, never the trainer
        until = t_cut + CUT_MAX_S
        while (
            time.time() < until and len(_rows(job, "metrics.jsonl")) - steps_at_cut <= MAX_LAG + 1
        ):
            job.check_alive()
            time.sleep(0.1)
        steps_at_back = len(_rows(job, "metrics.jsonl"))
        box.set_link("far", True)
        t_back = time.time()
        cut = int(published["version"])
        _wait(job, "a trained group the far engine sampled after the cut", lambda: any(
            g["engine"].startswith("engine1-far") and g["version_start"] > cut
            and g["outcome"] == "trained" for g in _rows(job, "groups.jsonl")), 180)  # fmt: skip
        job.procs["trainer0"].send_signal(signal.SIGINT)  # a graceful stop, then the summary
        (code,) = job.wait_trainers(120)
        summary = job.result()
        events = job.events()
    finally:
        job.stop()
        box.down()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [n for n in names.split() if n.startswith(f"{PREFIX}-{box.tag}-")]
    yield Run(
        job, summary, _rows(job, "metrics.jsonl"), _rows(job, "groups.jsonl"), events, cut,
        t_cut, t_back, steps_at_cut, steps_at_back, code, left,
    )  # fmt: skip


def _engine_ids(events: list[dict], prefix: str) -> set[str]:
    return {e["engine"] for e in events if e["event"] == "registered"
            and e["engine"].startswith(prefix)}  # fmt: skip


def test_near_and_far_engines_serve_one_version_sequence(run: Run):
    """Both engines served trained groups; every group's version stamps name versions the
    engine that sampled it had loaded (the far one's each rebuilt from a hash-checked delta or
    keyframe); every trained group within max_lag; no group lost (submitted = trained +
    filtered + in flight; the stop counts back only the groups already in the trainer, as it
    drains nothing: CI once stopped it with 5 of 8 still at the engines); the near engine loaded
    every version through gloo pushes, the far one only through the delta stream."""
    assert run.code == 128 + signal.SIGINT, run.job.log("trainer0")[-3000:]
    assert run.summary["stop_reason"].startswith("interrupted"), run.summary["stop_reason"]
    (near,) = _engine_ids(run.events, "engine0-near")
    (far,) = _engine_ids(run.events, "engine1-far")  # one registration: never dropped
    loop = run.summary["loop"]
    # a user's stop (SIGINT) drains nothing: the groups still at the engines stay in flight
    # (their prompts are served again on resume), so only those already back are counted
    assert_no_group_lost(loop, groups=run.groups)
    assert run.summary["in_flight_drained_after_stop"] == 0
    assert 0 <= run.summary["in_flight_waiting_in_trainer"] <= loop["in_flight"], loop
    steps = loop["steps"]
    assert [(r["step"], r["version"]) for r in run.metrics] == [(s, s) for s in range(1, steps + 1)]
    trained = [g for g in run.groups if g["outcome"] == "trained"]
    by_engine = {e: [g for g in trained if g["engine"] == e] for e in (near, far)}
    assert all(by_engine.values()), {e: len(g) for e, g in by_engine.items()}
    assert {g["engine"] for g in run.groups} == {near, far}
    assert all(0 <= g["lag"] <= MAX_LAG for g in trained), [g["lag"] for g in trained]
    assert all(g["lag"] == g["version"] - g["version_start"] for g in run.groups)
    loaded = {e: {0} for e in (near, far)}
    for ev in run.events:
        if ev["event"] == "loaded":
            loaded[ev["engine"]].add(int(ev["version"]))
    for g in run.groups:  # each stamp is a version its engine had loaded
        stamps = {g["version_start"]} | {s[0] for c in g["version_spans"] for s in c}
        assert stamps <= loaded[g["engine"]], (g, sorted(loaded[g["engine"]]))
    assert loaded[near] >= set(range(steps + 1)), sorted(set(range(steps + 1)) - loaded[near])
    # the run's data plane: every push committed on the near engine alone, never the far one
    pushes = run.summary["pushes"]
    assert [p["version"] for p in pushes] == list(range(1, steps + 1))
    assert all(p["engines"] == [near] for p in pushes), pushes[:3]
    # the far engine's versions: the delta stream's records, a keyframe first, then deltas
    far_pushes = run.summary["delta_pushes"]
    assert far_pushes and {p["engine"].split("@")[0] for p in far_pushes} == {far}
    got = [p for p in far_pushes if p["loaded"]]
    assert {p["version"] for p in got} == loaded[far] - {0}
    assert got[0]["base"] is None and all(p["base"] is not None for p in got[1:])
    assert [p["base"] for p in got[1:]] == [p["version"] for p in got[:-1]]
    assert all(p["wire_bytes"] < got[0]["wire_bytes"] for p in got[1:])


def test_a_far_link_cut_mid_push_stalls_only_the_far_engine(run: Run):
    """The far link went down while the far engine pulled the version just published: the
    trainer and the near engine went on (more than max_lag + 1 steps during the cut), the far
    engine loaded nothing meanwhile and was not dropped, leased nothing while more than
    max_lag behind the gateway's version, and once the link was back it loaded a version
    newer than the cut (a delta) and served a trained group sampled at it. Nothing is left:
    every namespace of the box is gone."""
    (far,) = _engine_ids(run.events, "engine1-far")
    assert run.steps_at_back - run.steps_at_cut > MAX_LAG + 1, (run.steps_at_cut, run.steps_at_back)
    assert not [e for e in run.events if e["event"] == "dropped"]
    far_loads = [e for e in run.events if e["event"] == "loaded" and e["engine"] == far]
    assert not [e for e in far_loads if run.t_cut <= e["t"] < run.t_back]
    assert not [e for e in far_loads if e["version"] >= run.cut_version and e["t"] < run.t_cut]
    after = [e for e in far_loads if e["t"] >= run.t_back and e["version"] > run.cut_version]
    assert after, far_loads[-3:]
    pushes = run.summary["delta_pushes"]
    newer = [p for p in pushes if p["loaded"] and p["version"] > run.cut_version]
    assert newer and newer[0]["base"] is not None, newer[:2]  # a delta against its old version
    held = 0
    for e in run.events:  # the far engine's leases: never more than max_lag behind
        if e.get("engine") != far:
            continue
        if e["event"] == "loaded":
            held = int(e["version"])
        elif e["event"] == "leased":
            assert e["weight_version"] == held and e["current"] - held <= MAX_LAG, e
    served = [g for g in run.groups if g["engine"] == far and g["version_start"] > run.cut_version]
    assert any(g["outcome"] == "trained" for g in served)
    assert run.namespaces_left == []
