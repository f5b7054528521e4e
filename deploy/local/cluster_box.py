"""A cluster in a box: N hosts as Linux network namespaces on one bridge, on this machine.

Each host is a network namespace with its own interface ``eth0`` and address (198.18.0.0/24,
the range RFC 2544 sets aside for benchmarking network devices, so no real network is ever
addressed), its own hostname (each process it runs gets a UTS namespace named after the
host), ``lo`` up, its own ``net.ipv4.ip_local_port_range`` and an ``/etc/hosts`` that names
every host of the box (``ip netns exec`` binds ``/etc/netns/NS/hosts`` over ``/etc/hosts``).
The bridge lives in a namespace of its own (the switch), so the machine's own network stack
has no route into the box and no address of the box reaches outside it. On the switch side
every host has one port, so a host's link can be cut (`ClusterBox.set_link`) or limited in
rate (`ClusterBox.limit_rate`, ``tc tbf`` both ways) without touching the host's own stack,
as a pulled cable or a slow WAN link would; each host may hold an nftables firewall
(`ClusterBox.firewall`) that admits only the TCP ports its role needs.

Every namespace's name carries a tag, by default ``p<PID>`` of the process that made the box:
`remove_stale` finds the boxes whose maker is gone (a killed test) and removes them with
every process inside, and `ClusterBox.down` runs on every path of the context manager.

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN), ``ip`` and ``unshare``; ``tc`` for rates and
``nft`` for firewalls. `check_support` raises `ClusterBoxError` naming what is missing.

As a command (``python deploy/local/cluster_box.py --help``): ``up TAG HOST...``, ``exec TAG
HOST -- CMD...``, ``link TAG HOST up|down``, ``limit TAG HOST MBIT``, ``down TAG``, ``clean``
(remove boxes whose maker is gone).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "jxrl"
"""First part of every namespace name of a box: ``jxrl-TAG-HOST`` and ``jxrl-TAG-sw``."""
SUBNET = "198.18.0"
"""The box's /24 (RFC 2544 benchmarking range); host i has SUBNET.(10 + i)."""
FIRST_HOST = 10
EPHEMERAL = (40000, 40999)
"""Each host's ``net.ipv4.ip_local_port_range``: the ports the kernel picks for listeners
bound to port 0 (gloo, jax_transfer, NCCL) and for outgoing connections."""
NETNS_ETC = Path("/etc/netns")


class ClusterBoxError(RuntimeError):
    """A box could not be made or used (no root, a tool missing, a command failed)."""


@dataclass(frozen=True)
class Host:
    """One host of a box: `name` (its hostname), `netns` (its namespace), `address` (IPv4 of
    its ``eth0``), `port` (its port's interface name on the switch)."""

    name: str
    netns: str
    address: str
    port: str


def _run(argv: Sequence[str], check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise ClusterBoxError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def check_support(need: Iterable[str] = ("ip", "unshare")) -> None:
    """Raise `ClusterBoxError` unless this process can make a box: root, the tools in `need`
    on PATH, and a network namespace that can actually be created and removed.

    Raises:
        ClusterBoxError: the message names what is missing (never a silent skip).
    """
    if os.geteuid() != 0:
        raise ClusterBoxError("a cluster in a box needs root (network and UTS namespaces)")
    missing = [t for t in need if shutil.which(t) is None]
    if missing:
        raise ClusterBoxError(f"a cluster in a box needs {', '.join(missing)} on PATH")
    probe = f"{PREFIX}-probe{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        raise ClusterBoxError(
            f"this machine cannot make network namespaces (ip netns add: {made.stderr.strip()})"
        )
    _run(["ip", "netns", "del", probe], check=False)


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(netns: str) -> None:
    """SIGKILL every process in `netns`, delete it and its /etc/netns folder."""
    for _ in range(20):
        pids = [int(p) for p in _run(["ip", "netns", "pids", netns], check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    _run(["ip", "netns", "del", netns], check=False)
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Remove every box whose tag is ``p<PID>`` of a process that no longer runs (a killed
    test's), with every process inside; returns the namespaces removed."""
    removed = []
    for netns in _namespaces():
        m = re.fullmatch(rf"{re.escape(prefix)}-p(\d+)-.+", netns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace(netns)
            removed.append(netns)
    return removed


class ClusterBox:
    """A box of hosts named `names` (hostnames: letters, digits, '-'), host i at
    SUBNET.(10 + i). A context manager: `up` on entry, `down` on every exit.

    Args:
        names: the hosts' names, at most 200.
        tag: the namespaces' tag (default ``p<PID>``: `remove_stale` removes the box once this
            process is gone); letters and digits, at most 12.
        ephemeral: each host's ``net.ipv4.ip_local_port_range`` (first, last).

    Raises:
        ValueError: a bad name or tag, a repeated name, more than 200 hosts.
    """

    def __init__(
        self,
        names: Sequence[str],
        tag: str | None = None,
        ephemeral: tuple[int, int] = EPHEMERAL,
    ) -> None:
        if not names or len(names) > 200 or len(set(names)) != len(names):
            raise ValueError(f"expected 1..200 distinct host names, got {list(names)}")
        for name in names:
            if not re.fullmatch(r"[a-z][a-z0-9-]{0,30}", name):
                raise ValueError(f"host name {name!r}: lowercase letters, digits and '-'")
        self.tag = tag or f"p{os.getpid()}"
        if not re.fullmatch(r"[a-z0-9]{1,12}", self.tag):
            raise ValueError(f"tag {self.tag!r}: lowercase letters and digits, at most 12")
        self.ephemeral = ephemeral
        self.switch = f"{PREFIX}-{self.tag}-sw"
        self.hosts = {
            name: Host(name, f"{PREFIX}-{self.tag}-{name}", f"{SUBNET}.{FIRST_HOST + i}", f"p{i}")
            for i, name in enumerate(names)
        }
        self._started: list[subprocess.Popen] = []

    def __enter__(self) -> ClusterBox:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def host(self, name: str) -> Host:
        """The host called `name`.

        Raises:
            KeyError: no such host (the message lists the box's hosts).
        """
        if name not in self.hosts:
            raise KeyError(f"no host {name!r} in this box; hosts: {sorted(self.hosts)}")
        return self.hosts[name]

    def address(self, name: str) -> str:
        """The IPv4 address of host `name`."""
        return self.host(name).address

    def up(self) -> None:
        """Make the switch and every host (see the module docstring); stale boxes go first.

        Raises:
            ClusterBoxError: a command failed or this machine cannot make namespaces.
        """
        check_support()
        remove_stale()
        sw = self.switch
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{h.address} {h.name}\n" for h in self.hosts.values()
        )
        lo, hi = self.ephemeral
        for h in self.hosts.values():
            _run(["ip", "netns", "add", h.netns])
            (NETNS_ETC / h.netns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / h.netns / "hosts").write_text(hosts_file)
            _run(["ip", "-n", sw, "link", "add", h.port, "type", "veth", "peer", "name", "eth0",
                  "netns", h.netns])  # fmt: skip
            _run(["ip", "-n", sw, "link", "set", h.port, "master", "br0", "up"])
            _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])
            _run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0"])
            _run(["ip", "-n", h.netns, "link", "set", "eth0", "up"])
            _run(["ip", "netns", "exec", h.netns, "sysctl", "-qw",
                  f"net.ipv4.ip_local_port_range={lo} {hi}"])  # fmt: skip

    def down(self) -> None:
        """Kill every process in the box and remove its namespaces (idempotent).

        What `popen` started is killed by its pid first: a process that has not yet entered
        its namespace (``ip netns exec`` not yet past ``setns``) is not among the namespace's
        pids, and would otherwise outlive the box.
        """
        for proc in self._started:
            if proc.poll() is None:
                proc.kill()
        for h in self.hosts.values():
            _kill_namespace(h.netns)
        _kill_namespace(self.switch)

    def argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run on host `name`: in its network namespace, in a UTS namespace
        of its own whose hostname is `name`."""
        h = self.host(name)
        return [
            "ip", "netns", "exec", h.netns, "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', h.name, *argv,
        ]  # fmt: skip

    def popen(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen:
        """Start `argv` on host `name` (`subprocess.Popen` keywords pass through); `down` kills
        it with the host."""
        proc = subprocess.Popen(self.argv(name, argv), env=dict(env) if env else None, **kw)
        self._started = [p for p in self._started if p.poll() is None] + [proc]
        return proc

    def run(self, name: str, argv: Sequence[str], check: bool = True, **kw: Any) -> str:
        """Run `argv` on host `name` to its end; returns its stdout.

        Raises:
            ClusterBoxError: it exited non-zero (with `check`; stderr in the message).
        """
        return _run(self.argv(name, argv), check=check, **kw).stdout

    def set_link(self, name: str, up: bool) -> None:
        """Cut (``up=False``) or restore host `name`'s link at the switch: its own interface
        loses carrier, nothing is sent or received, no connection is reset."""
        h = self.host(name)
        _run(["ip", "-n", self.switch, "link", "set", h.port, "up" if up else "down"])

    def limit_rate(self, name: str, mbit: float | None) -> None:
        """Limit host `name`'s link to `mbit` Mbit/s each way (``tc tbf``: the switch port's
        egress toward the host, the host's ``eth0`` egress toward the switch); None lifts it.

        Raises:
            ClusterBoxError: ``tc`` is missing or refused the rate.
        """
        h = self.host(name)
        for ns, dev in ((self.switch, h.port), (h.netns, "eth0")):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            if mbit is not None:
                burst = max(32 * 1024, int(mbit * 1e6 / 8 / 100))  # bytes: 10 ms at the rate
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                      f"{mbit}mbit", "burst", str(burst), "latency", "200ms"])  # fmt: skip

    def firewall(self, name: str, tcp_ports: Iterable[int | tuple[int, int]]) -> None:
        """An nftables ruleset on host `name` that drops every new inbound TCP/UDP connection
        but those to `tcp_ports` (a port or an inclusive (first, last) range) from the box;
        loopback, established flows and ICMP pass. Replaces the host's earlier ruleset.

        Raises:
            ClusterBoxError: ``nft`` is missing or refused the ruleset.
        """
        items = [f"{p[0]}-{p[1]}" if isinstance(p, tuple) else str(p) for p in tcp_ports]
        accept = f"tcp dport {{ {', '.join(items)} }} accept" if items else ""
        rules = (
            "flush ruleset\n"
            "table inet jaxrl {\n"
            "  chain input {\n"
            "    type filter hook input priority 0; policy drop;\n"
            "    iif lo accept\n"
            "    ct state established,related accept\n"
            "    meta l4proto { icmp, ipv6-icmp } accept\n"
            f"    {accept}\n"
            "    counter\n"
            "  }\n"
            "}\n"
        )
        _run(["ip", "netns", "exec", self.host(name).netns, "nft", "-f", "-"], input=rules)

    def dropped(self, name: str) -> int:
        """Packets host `name`'s firewall dropped so far (the input chain's final counter)."""
        out = self.run(name, ["nft", "list", "chain", "inet", "jaxrl", "input"])
        m = re.search(r"counter packets (\d+)", out)
        return int(m.group(1)) if m else 0

    def listening(self, name: str) -> list[tuple[str, int]]:
        """(address, port) of every TCP socket listening on host `name`."""
        out = self.run(name, ["ss", "-ltnH"])
        found = []
        for line in out.splitlines():
            local = line.split()[3]
            addr, _, port = local.rpartition(":")
            found.append((addr.strip("[]"), int(port)))
        return found


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python deploy/local/cluster_box.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make a box: TAG HOST...")
    up.add_argument("tag")
    up.add_argument("hosts", nargs="+")
    ex = sub.add_parser("exec", help="run a command on a host: TAG HOST -- CMD...")
    ex.add_argument("tag")
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    link = sub.add_parser("link", help="cut or restore a host's link: TAG HOST up|down")
    link.add_argument("tag")
    link.add_argument("host")
    link.add_argument("state", choices=("up", "down"))
    lim = sub.add_parser("limit", help="limit a host's link: TAG HOST MBIT (0 lifts it)")
    lim.add_argument("tag")
    lim.add_argument("host")
    lim.add_argument("mbit", type=float)
    down = sub.add_parser("down", help="remove a box and everything in it: TAG")
    down.add_argument("tag")
    sub.add_parser("clean", help="remove boxes whose maker is gone")
    a = ap.parse_args(argv)

    def existing(tag: str) -> ClusterBox:
        prefix = f"{PREFIX}-{tag}-"
        names = [n[len(prefix) :] for n in _namespaces() if n.startswith(prefix)]
        hosts = sorted((n for n in names if n != "sw"), key=lambda n: _host_index(tag, n))
        if not hosts:
            raise ClusterBoxError(f"no box tagged {tag!r}")
        return ClusterBox(hosts, tag=tag)

    try:
        if a.cmd == "up":
            box = ClusterBox(a.hosts, tag=a.tag)
            box.up()
            for h in box.hosts.values():
                print(f"{h.name} {h.address} netns={h.netns}")
        elif a.cmd == "exec":
            command = a.command[1:] if a.command[:1] == ["--"] else a.command
            return subprocess.call(existing(a.tag).argv(a.host, command))
        elif a.cmd == "link":
            existing(a.tag).set_link(a.host, a.state == "up")
        elif a.cmd == "limit":
            existing(a.tag).limit_rate(a.host, a.mbit or None)
        elif a.cmd == "down":
            existing(a.tag).down()
        else:
            print("\n".join(remove_stale()) or "no stale box")
    except (ClusterBoxError, KeyError, ValueError) as err:
        print(f"cluster_box: {err}", file=sys.stderr)
        return 1
    return 0


def _host_index(tag: str, name: str) -> int:
    """The index of host `name` in box `tag`, read back from its address."""
    out = _run(["ip", "-n", f"{PREFIX}-{tag}-{name}", "-4", "-o", "addr", "show", "eth0"]).stdout
    m = re.search(rf"{re.escape(SUBNET)}\.(\d+)/", out)
    return int(m.group(1)) - FIRST_HOST if m else 0


if __name__ == "__main__":
    sys.exit(_main())
