"""A TCP proxy between one node and its scheduler, for tests that lose what the scheduler
answered at a moment they pick: `hold_replies()` drops everything the scheduler sends from then
on (what the node sends still goes), `cut()` closes every connection through it, and the
connections made after that are plain again. With `source`, the proxy connects to the target
from that loopback address (127.0.0.2, ...): the target sees its clients as another host.
"""

from __future__ import annotations

import contextlib
import socket
import threading

CHUNK = 64 * 1024


class Proxy:
    """Listens on a loopback port of its own (`port`); each connection is forwarded to
    `target` by two threads, one per direction."""

    def __init__(self, target: tuple[str, int], source: str | None = None) -> None:
        self.target = target
        self._source = None if source is None else (source, 0)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._holding = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def hold_replies(self) -> None:
        self._holding = True

    def cut(self) -> None:
        """Close every connection through the proxy; the next ones are forwarded whole."""
        with self._lock:
            gone, self._open = self._open, []
            self._holding = False
        for sock in gone:
            _close(sock)

    def close(self) -> None:
        _close(self._listener)
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(
                    self.target, timeout=5.0, source_address=self._source
                )
            except OSError:
                _close(client)  # the scheduler is not up: the node sees a refused connection
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
            for source, sink, replies in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(
                    target=self._pump, args=(source, sink, replies), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        while True:
            try:
                data = source.recv(CHUNK)
            except OSError:
                break
            if not data:
                break
            if replies and self._holding:
                continue  # dropped: the test cuts this connection before it matters
            try:
                sink.sendall(data)
            except OSError:
                break
        _close(source)
        _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
