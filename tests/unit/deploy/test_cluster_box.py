"""The cluster in a box (`deploy.local.cluster_box`): hosts with their own names, addresses and
port ranges that reach each other by name; a cut link, a rate limit and a firewall; nothing
left behind by `down`, nor by a maker that was SIGKILLed (`remove_stale`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from deploy.local.cluster_box import (
    PREFIX,
    ClusterBox,
    ClusterBoxError,
    check_support,
    remove_stale,
)
from tests.integration.cluster_harness import can_connect, listen_briefly


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture
def box():
    try:
        check_support(("ip", "unshare", "nft", "tc", "ss"))
    except ClusterBoxError as err:
        pytest.fail(f"the cluster in a box cannot run here: {err}")
    with ClusterBox(["alpha", "beta"]) as b:
        yield b


def test_hosts_have_their_own_name_address_and_port_range(box):
    assert box.run("alpha", ["hostname"]).strip() == "alpha"
    assert box.run("beta", ["hostname", "-I"]).split() == ["198.18.0.11"]
    assert box.run("beta", ["sysctl", "-n", "net.ipv4.ip_local_port_range"]).split() == [
        "40000", "40999",
    ]  # fmt: skip
    assert box.run("alpha", ["getent", "hosts", "beta"]).split() == ["198.18.0.11", "beta"]
    server = listen_briefly(box, "beta", 7000)
    try:
        deadline = time.monotonic() + 10
        while ("198.18.0.11", 7000) not in box.listening("beta") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert box.listening("beta") == [("198.18.0.11", 7000)]
        assert box.listening("alpha") == []
        assert can_connect(box, "alpha", "beta", 7000)
        box.set_link("beta", False)  # a pulled cable: the connect times out
        assert not can_connect(box, "alpha", "beta", 7000, timeout_s=1)
        box.set_link("beta", True)
        assert can_connect(box, "alpha", "beta", 7000)
        box.firewall("beta", [(7001, 7002)])  # 7000 is not admitted: dropped and counted
        assert not can_connect(box, "alpha", "beta", 7000, timeout_s=1)
        assert box.dropped("beta") >= 1
        box.firewall("beta", [7000])
        assert can_connect(box, "alpha", "beta", 7000)
    finally:
        server.kill()


def test_rate_limit_is_a_tbf_both_ways(box):
    box.limit_rate("alpha", 20)
    for ns, dev in ((box.switch, "p0"), (box.host("alpha").netns, "eth0")):
        qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev],
                               capture_output=True, text=True).stdout  # fmt: skip
        assert "tbf" in qdisc and "rate 20Mbit" in qdisc, qdisc
    box.limit_rate("alpha", None)
    qdisc = subprocess.run(["tc", "-n", box.switch, "qdisc", "show", "dev", "p0"],
                           capture_output=True, text=True).stdout  # fmt: skip
    assert "tbf" not in qdisc


def test_down_kills_what_runs_in_the_box_and_removes_it():
    with ClusterBox(["gamma"]) as b:
        sleeper = b.popen("gamma", ["sleep", "600"])
        names = {b.host("gamma").netns, b.switch}
        assert names <= _namespaces()
    assert sleeper.wait(10) == -signal.SIGKILL
    assert not names & _namespaces()
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in names)


def test_down_at_once_after_popen_kills_the_process_still_entering_its_host():
    # `ip netns exec` may not have joined the namespace yet: it is not among `ip netns pids`
    # (CI once saw such a sleeper outlive its box); down kills what popen started by its pid.
    for _ in range(5):
        with ClusterBox(["eps"]) as b:
            sleepers = [b.popen("eps", ["sleep", "600"]) for _ in range(4)]
        assert [s.wait(10) for s in sleepers] == [-signal.SIGKILL] * 4


def test_a_box_whose_maker_was_killed_is_removed_by_the_next():
    code = (
        "import sys, time\n"
        "from deploy.local.cluster_box import ClusterBox\n"
        "b = ClusterBox(['delta']); b.up(); b.popen('delta', ['sleep', '600'])\n"
        "print('up', flush=True); time.sleep(600)\n"
    )
    maker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert maker.stdout is not None and maker.stdout.readline().strip() == "up"
    stale = {f"{PREFIX}-p{maker.pid}-delta", f"{PREFIX}-p{maker.pid}-sw"}
    assert stale <= _namespaces()
    assert not stale & set(remove_stale())  # its maker lives: not stale
    maker.kill()
    maker.wait()
    assert stale <= set(remove_stale())
    assert not stale & _namespaces()


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="distinct host names"):
        ClusterBox(["a", "a"])
    with pytest.raises(ValueError, match="lowercase letters, digits and '-'"):
        ClusterBox(["Node_1"])
    with pytest.raises(KeyError, match="no host 'zeta' in this box"):
        ClusterBox(["a"]).host("zeta")
