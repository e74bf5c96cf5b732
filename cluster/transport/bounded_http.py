"""The HTTP server of a /metrics port (the scheduler's and each worker's): bounded against
whoever reaches the port.

Each connection holds a thread for as long as it is open, so a server that takes every
connection hands an outsider its process's threads and descriptors: a few thousand idle
connections and a worker's checkpoint writes, gRPC and NCCL run out of descriptors.
`BoundedServer` serves at most CONNECTIONS at once and CONNECTIONS_PER_ADDRESS from one
address, each for a bounded time, and `BoundedHttp` runs one on a thread of its own for a WSGI
app (prometheus_client's `make_wsgi_app`).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

log = logging.getLogger("cluster.metrics")

# Connections the port serves at once, in all and from one address (a scraper needs one).
# Past the address's share, a connection is closed at once; with every slot taken, a new one
# takes the slot of the oldest slow one (`BoundedServer`). Each holds a thread.
CONNECTIONS = 32
CONNECTIONS_PER_ADDRESS = 4
# Seconds a connection has, from its accept, to send its whole request (line and headers), and
# then, once its answer is made (within the server's `making_s`), to take it; past either it is
# closed, however it trickles its bytes.
REQUEST_S = 5.0
ANSWER_S = 5.0
# How often the server closes the connections past their deadline.
SWEEP_S = 0.25

App = Callable[..., Any]  # a WSGI application


class _Handler(WSGIRequestHandler):
    """One connection, one request; nothing logged per request. Its deadlines are the
    server's (`BoundedServer`); the socket's own timeout only backs them up."""

    timeout = REQUEST_S
    server: BoundedServer

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if parsed:  # its request line and headers are in: it is being answered
            self.server.phase(self.request, _Phase.ANSWERING)
        return parsed

    def get_environ(self) -> dict[str, Any]:
        environ: dict[str, Any] = super().get_environ()
        environ[_CONNECTION] = self.request
        return environ

    def log_message(self, format: str, *args: Any) -> None:
        pass


_CONNECTION = "cluster.metrics.connection"


class _Phase(enum.Enum):
    REQUEST = "request"  # its request is being read (slow: may give its slot up)
    ANSWERING = "answering"  # its answer is being made (a scrape: keeps its slot)
    TAKING = "taking"  # its answer is being written (slow: may give its slot up)


@dataclass
class _Connection:
    host: str
    accepted: float
    phase: _Phase
    deadline: float


class BoundedServer(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per connection, at most CONNECTIONS of them and CONNECTIONS_PER_ADDRESS from
    one address, each for a bounded time: its whole request within REQUEST_S of its accept, its
    answer made within `making_s` and taken within ANSWER_S once made (closed then, by the
    serving thread's sweep, however it trickles its bytes).

    A connection past its address's share is closed at once, before a thread or a byte is spent
    on it. With every slot taken, a new one takes the slot of a slow connection (still sending
    its request, or taking its answer), which is closed: the oldest of the address that holds
    the most. Slots held open are held only while no one else asks, so a scrape from another
    address gets in at once (and a scraper, with one connection that takes milliseconds, is
    the last whose slot is taken). Only connections whose answer is being made keep theirs."""

    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: a burst of connections waits, not dropped

    def __init__(
        self, address: tuple[str, int], family: socket.AddressFamily, making_s: float
    ) -> None:
        self.address_family = family
        self.making_s = making_s
        self._lock = threading.Lock()
        self._open: dict[socket.socket, _Connection] = {}
        super().__init__(address, _Handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        host = str(client_address[0])
        now = time.monotonic()
        with self._lock:
            held = collections.Counter(c.host for c in self._open.values())
            if held[host] >= CONNECTIONS_PER_ADDRESS:
                return False
            if len(self._open) >= CONNECTIONS:
                slow = [
                    (-held[c.host], c.accepted, s)
                    for s, c in self._open.items()
                    if c.phase is not _Phase.ANSWERING
                ]
                if not slow:
                    return False
                self._cut(min(slow, key=lambda held_oldest: held_oldest[:2])[2])
            self._open[request] = _Connection(host, now, _Phase.REQUEST, now + REQUEST_S)
        return True

    def phase(self, request: socket.socket, phase: _Phase) -> None:
        """The connection of `request` is now in `phase`, with that phase's time."""
        now = time.monotonic()
        deadline = now + (self.making_s + ANSWER_S if phase is _Phase.ANSWERING else ANSWER_S)
        with self._lock:
            connection = self._open.get(request)
            if connection is not None:
                connection.phase, connection.deadline = phase, deadline

    def timed(self, app: App) -> App:
        """`app`, after which the connection takes its answer (within ANSWER_S)."""

        def answered(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            body = app(environ, start_response)
            self.phase(environ[_CONNECTION], _Phase.TAKING)
            return body

        return answered

    def service_actions(self) -> None:
        """Between accepts (at least every SWEEP_S): close what is past its time."""
        now = time.monotonic()
        with self._lock:
            for request in [s for s, c in self._open.items() if c.deadline <= now]:
                self._cut(request)

    def _cut(self, request: socket.socket) -> None:
        """Close the connection of `request` (its thread ends at once) and free its slot; under
        the lock, which its thread takes before it closes the socket (`shutdown_request`)."""
        del self._open[request]
        with contextlib.suppress(OSError):
            request.shutdown(socket.SHUT_RDWR)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out, was cut or went away is no error of the server's."""
        log.debug("a metrics connection from %s ended early", client_address[0], exc_info=True)


def listening_on(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    """The address family and address to listen on for `host` (IPv4 or IPv6; '': every
    address)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return family, (str(sockaddr[0]), port)


class BoundedHttp:
    """`app` served at host:port by a `BoundedServer` on threads of its own (daemons): bounded
    in threads, connections and the time a connection may take, so that connections left open
    by anyone who reaches the port cost a bounded amount and keep no scrape from another
    address out. `making_s`: the longest `app` takes to make an answer."""

    def __init__(self, app: App, host: str, port: int, *, making_s: float, name: str) -> None:
        self.app = app
        self.host = host
        self.requested_port = port
        self.making_s = making_s
        self.name = name
        self.port = 0
        self._server: BoundedServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Listen and serve; the port (the one asked for, or the one had for 0). OSError when
        the address cannot be had (gaierror: a host that does not resolve)."""
        family, address = listening_on(self.host, self.requested_port)
        server = BoundedServer(address, family, self.making_s)
        server.set_app(server.timed(self.app))
        thread = threading.Thread(
            target=server.serve_forever, args=(SWEEP_S,), name=self.name, daemon=True
        )
        thread.start()
        self._server, self._thread = server, thread
        self.port = int(server.server_port)
        return self.port

    def stop(self) -> None:
        """Stop serving and close the port (blocks up to a sweep, and 5 s for the thread)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
