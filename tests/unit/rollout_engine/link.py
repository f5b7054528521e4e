"""A TCP link on loopback that a test can cut and restore (loaded by path, not a test module):
`Link(upstream_port)` listens on its own 127.0.0.1 port and forwards every connection to the
upstream one. `cut()` closes the listener and the client side of every connection (the
client's calls fail UNAVAILABLE) and leaves the upstream side open and silent, so the server
sees what a link that went down shows it: nothing at all (no reset, no close). `restore()`
listens again on the same port.
"""

from __future__ import annotations

import socket
import threading


class Link:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`upstream` until `cut()`; `restore()` reopens.

    Attributes:
        port: the port clients connect to.
        address: "127.0.0.1:port".
    """

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._severed: list[socket.socket] = []  # upstream sockets left open by `cut`
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"

    def _listen(self, port: int) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(64)
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()
        return s

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                down, _ = listener.accept()
            except OSError:  # the listener was closed: the link is cut
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                down.close()
                continue
            with self._lock:
                self._pairs.append((down, up))
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            if s in self._severed:  # cut: the server must see silence, not a close
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        """Close the listener and the client side of every forwarded connection; the
        upstream side stays open and silent."""
        try:  # wakes the accept() blocked on it: a close alone leaves it listening
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self._severed += [up for _, up in pairs]
        for down, _ in pairs:
            try:
                down.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            down.close()

    def close(self) -> None:
        """Cut the link and close the upstream sides too."""
        self.cut()
        with self._lock:
            severed, self._severed = self._severed, []
        for up in severed:
            up.close()

    def restore(self) -> None:
        """Listen on the same port again."""
        self._listener = self._listen(self.port)
