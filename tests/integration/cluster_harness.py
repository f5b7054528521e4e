"""The cluster in a box for tests: hosts as network namespaces (`deploy.local.cluster_box`),
the run's processes started on them with the launcher's own command lines, and the port
table of the "Ports" section of docs/clusters.md as each host's firewall.

`cluster_box` (a fixture factory) makes a box and removes it on every path; a machine where
namespaces cannot be made fails the test with the reason (never a silent skip). `MainJobOnHosts`
lays out the main job as on separate hosts: the gateway (TLS, pinned port) and trainer
process 0 on one host, trainer process 1 on another, one engine per further host.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence

import pytest

from deploy.local.cluster_box import ClusterBox, ClusterBoxError, check_support
from deploy.local.hosts_job import MainJobOnHosts

__all__ = ["MainJobOnHosts", "can_connect", "cluster_box", "listen_briefly"]


def can_connect(box: ClusterBox, host: str, address: str, port: int, timeout_s: float = 2) -> bool:
    """Whether a TCP connection from `host` to address:port is accepted within `timeout_s`
    (a firewall's drop shows as a timeout, a closed port as a refusal: both False)."""
    code = (
        "import socket,sys\n"
        f"s=socket.socket(); s.settimeout({timeout_s})\n"
        f"sys.exit(s.connect_ex(({address!r}, {port})) != 0)"
    )
    return subprocess.run(box.argv(host, [sys.executable, "-c", code])).returncode == 0


def listen_briefly(box: ClusterBox, host: str, port: int, seconds: float = 30) -> subprocess.Popen:
    """A TCP listener on `host`'s address and `port` for `seconds` (a port outside the port
    table, to show the firewall drops it)."""
    code = (
        "import socket,time\n"
        f"s=socket.socket(); s.bind(({box.address(host)!r}, {port})); s.listen()\n"
        f"time.sleep({seconds})"
    )
    return box.popen(host, [sys.executable, "-c", code])


@pytest.fixture
def cluster_box() -> Iterator:
    """Factory: cluster_box(["node0", ...]) -> a `ClusterBox` that is up; every box made is
    removed when the test ends, however it ends. Fails (not skips) where namespaces cannot be
    made."""
    boxes: list[ClusterBox] = []

    def make(names: Sequence[str]) -> ClusterBox:
        try:
            check_support(("ip", "unshare", "nft", "tc", "ss"))
        except ClusterBoxError as err:
            pytest.fail(f"the cluster in a box cannot run here: {err}")
        box = ClusterBox(names)
        boxes.append(box)
        box.up()
        return box

    try:
        yield make
    finally:
        for box in boxes:
            box.down()
