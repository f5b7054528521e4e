"""Ports and binding of the collective data plane: the store takes the port (or the first free
port of the range) it is given, and with host 127.0.0.1 nothing of a real gloo push between two
processes listens beyond the loopback (the store and both ranks' gloo listeners)."""

import socket
import subprocess
import sys

import psutil
import pytest

from transport.collective import bind_listener, local_address_towards

# One rank of a push: "send HOST PORT COUNT" or "recv HOST PORT". Prints the store's port
# (sender), then "pushed" once a 1 MB version moved, then holds the group until stdin closes.
RANK = r"""
import sys, torch
from transport.gloo import GlooReceiver, GlooSender
from transport.manifest import Manifest
role, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
w = {"a.weight": torch.arange(262144, dtype=torch.float32)}
manifest = Manifest.of(1, [("a.weight", (262144,))], "float32", 1 << 20)
if role == "send":
    side = GlooSender(host, port, 1, timeout_s=120, port_count=int(sys.argv[4]))
    print(side.port, flush=True)
    side.send(manifest, w.items())
else:
    side = GlooReceiver(host, port, 1, 2, timeout_s=120)
    got = {}
    side.receive(manifest, lambda bucket: got.update((n, t.clone()) for n, t in bucket))
    assert torch.equal(got["a.weight"], w["a.weight"])
print("pushed", flush=True)
sys.stdin.read()
side.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(pid: int) -> list[tuple[str, int]]:
    conns = psutil.Process(pid).net_connections("tcp")
    return sorted((c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN)


def test_listener_binds_the_host_only_and_takes_the_first_free_port_of_the_range():
    taken = bind_listener("127.0.0.1", 0)
    port = int(taken.getsockname()[1])
    try:
        with bind_listener("127.0.0.1", port, 3) as s:
            assert s.getsockname()[0] == "127.0.0.1"
            assert s.getsockname()[1] in (port + 1, port + 2)  # past the taken one
        with pytest.raises(OSError, match=f"no free port to listen on at 127.0.0.1 in {port}"):
            bind_listener("127.0.0.1", port, 1)
        with pytest.raises(ValueError, match="port 65535, port_count 2"):
            bind_listener("127.0.0.1", 65535, 2)
    finally:
        taken.close()
    assert local_address_towards("127.0.0.1", port) == "127.0.0.1"


def test_push_between_processes_listens_on_the_loopback_and_the_given_port(tmp_path):
    port = _free_port()
    blocker = bind_listener("127.0.0.1", port)  # the first port of the range is taken
    procs: list[subprocess.Popen] = []
    try:
        base = [sys.executable, "-c", RANK]
        sender = subprocess.Popen(
            [*base, "send", "127.0.0.1", str(port), "2"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        procs.append(sender)
        store_port = int(sender.stdout.readline())
        assert store_port == port + 1  # the next one of the range
        receiver = subprocess.Popen(
            [*base, "recv", "127.0.0.1", str(store_port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        procs.append(receiver)
        assert sender.stdout.readline().strip() == "pushed"
        assert receiver.stdout.readline().strip() == "pushed"
        sent, got = _listening(sender.pid), _listening(receiver.pid)
        # the sender: the store on the given port and its gloo listener; the receiver: its
        # gloo listener; every one on 127.0.0.1, none on 0.0.0.0 or ::
        assert len(sent) == 2 and ("127.0.0.1", store_port) in sent
        assert len(got) == 1
        assert {ip for ip, _ in sent + got} == {"127.0.0.1"}
        for p in procs:
            p.stdin.close()
        assert [p.wait(120) for p in procs] == [0, 0]
    finally:
        blocker.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
