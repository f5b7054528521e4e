"""Issue 25 item 2: the main job across hosts of a cluster in a box (network namespaces on one
bridge, each with its own address, hostname and firewall).

node0 runs the gateway (TLS with the project's own certificate, pinned port) and trainer
process 0 (jax.distributed coordinator, data-plane store); node1 trainer process 1 (one
jax.distributed job over real addresses, 2 processes x 1 CPU device); node2 a JAX engine and
node3 a vLLM engine. Every trainer process sends its own blocks of each version to both
engines (fan-in over gloo across hosts). Each host's nftables firewall admits only the ports
docs/clusters.md's port table names for its roles, so the run passing proves the table complete.
Real processes; run under the heavy lock.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.cluster_harness import MainJobOnHosts, can_connect, listen_briefly
from tests.integration.smoke_job import assert_no_group_lost, jsonl_rows

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
STEPS, PROMPTS = 4, 4  # configs/smoke.yaml
LOOPBACK = {"127.0.0.1", "::1"}


def test_main_job_across_four_hosts_behind_firewalls(cluster_box, tmp_path):
    """4 steps at versions 1..4; both engines serve version 4; both trainer processes sent
    every version (process 1's sends log); every group accounted for once
    (`submitted == trained + filtered + in_flight`, no sample id trained twice); the firewalls
    dropped packets (they were in force) and every listening socket of every host is bound to
    that host's address or to loopback, never to every interface; and the firewalls are in
    force (a listener on a port outside the table cannot be reached from another host)."""
    box = cluster_box(["node0", "node1", "node2", "node3"])
    job = MainJobOnHosts(
        box, tmp_path / "run", tmp_path / "cache", trainer_hosts=["node0", "node1"],
        engine_hosts=["node2", "node3"],
        overrides=["launch.engine_backends=[jax, vllm]", "launch.engine_dtype=float32",
                   "launch.trainer_devices=1", "eval.size=0"],
    )  # fmt: skip
    listening: dict[str, list[tuple[str, int]]] = {}
    try:
        job.start()
        job.wait_for_file(tmp_path / "run" / "metrics.jsonl", 600)
        for host in box.hosts:  # mid-run: every process of the run is up and listening
            listening[host] = box.listening(host)
        # the firewalls are in force: a port outside the table is dropped, the gateway's passes
        stray = listen_briefly(box, "node0", 50099)
        gw = box.address("node0")
        reach = (can_connect(box, "node1", gw, 50051), can_connect(box, "node1", gw, 50099))
        stray.kill()
        dropped = box.dropped("node0")
        codes = job.wait_trainers(600)
    finally:
        job.stop()
    logs = {n: job.log(n)[-3000:] for n in ("trainer0", "trainer1")}
    assert codes == [0, 0], logs

    for host, socks in listening.items():
        socks = [(a.removeprefix("::ffff:"), p) for a, p in socks]  # IPv4-mapped: the same
        listening[host] = socks
        stray = [(a, p) for a, p in socks if a not in LOOPBACK and a != box.address(host)]
        assert stray == [], f"{host} listens beyond its address: {stray}"
    assert (gw, 50051) in listening["node0"] and (gw, 50052) in listening["node0"]

    metrics = jsonl_rows(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["version"]) for r in metrics] == [(s, s) for s in range(1, STEPS + 1)]
    result = json.loads((tmp_path / "run" / "trainer_result.json").read_text())
    assert sorted(result["engine_versions"].values()) == [STEPS, STEPS]
    loop = result["loop"]
    assert (loop["steps"], loop["stop_reason"]) == (STEPS, "completed")
    assert_no_group_lost(loop, groups=jsonl_rows(tmp_path / "run" / "groups.jsonl"))
    assert loop["trained_groups"] == STEPS * PROMPTS
    sends = [r for r in jsonl_rows(tmp_path / "run" / "logs" / "trainer1_sends.jsonl") if r["ok"]]
    assert [r["version"] for r in sends] == list(range(1, STEPS + 1))
    events = jsonl_rows(tmp_path / "run" / "logs" / "gateway_events.jsonl")
    loaded = sorted(e["engine"].rsplit("-", 1)[0] for e in events
                    if e["event"] == "loaded" and e["version"] == STEPS)  # fmt: skip
    assert loaded == ["engine0-node2", "engine1-node3"], loaded
    assert reach == (True, False) and dropped > 0, (reach, dropped)
