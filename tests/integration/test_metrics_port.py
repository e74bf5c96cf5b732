"""The scheduler's metrics port against whoever reaches it: a real scheduler serving /metrics on
loopback, and callers from other loopback addresses (127.0.0.2 and up). Hundreds of connections
that send nothing hold a bounded number of the server's threads, each for at most
REQUEST_S, and the rest are closed at once; connections that trickle their request a
byte at a time are closed at that deadline all the same; and with every slot held by such
connections from a few addresses, a real scrape from another address gets through at once."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time

import pytest

from cluster.scheduler import SchedulerServer
from cluster.transport import bounded_http
from cluster.transport.bounded_http import (
    CONNECTIONS,
    CONNECTIONS_PER_ADDRESS,
    REQUEST_S,
    SWEEP_S,
)
from tests.aio import BOUND_S, eventually
from tests.scrape import ON, form, scrape, settings, value

IDLE_CONNECTIONS = 400
OUTSIDER = "127.0.0.2"


def open_idle(port: int, count: int, outsider: str = OUTSIDER) -> list[socket.socket]:
    """Up to `count` connections from `outsider` to the metrics port that send nothing (it stops
    at the first connection the port does not take within 3 s)."""
    held = []
    for _ in range(count):
        conn = socket.socket()
        conn.settimeout(3.0)  # a dropped SYN is sent again after 1 s
        try:
            conn.bind((outsider, 0))
            conn.connect(("127.0.0.1", port))
        except OSError:
            conn.close()
            break
        held.append(conn)
    return held


def still_open(held: list[socket.socket], within_s: float) -> list[socket.socket]:
    """Those of `held` the server did not close within `within_s` (from now)."""
    deadline = time.monotonic() + within_s
    left = []
    for conn in held:
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            if conn.recv(1) == b"":
                continue
        except ConnectionResetError:
            continue
        except TimeoutError:
            pass
        left.append(conn)
    return left


def serving_threads() -> int:
    """The server's threads that serve one connection each (socketserver names them)."""
    return sum("process_request_thread" in t.name for t in threading.enumerate())


async def test_idle_connections_hold_few_threads_briefly_and_keep_no_scrape_out() -> None:
    async with SchedulerServer(settings(), observe=ON) as server:
        await form(server)
        port = server.observing.metrics_port
        assert port is not None
        held = await asyncio.to_thread(open_idle, port, IDLE_CONNECTIONS)
        try:
            assert len(held) == IDLE_CONNECTIONS  # taken at once, none left waiting
            assert serving_threads() <= CONNECTIONS_PER_ADDRESS
            started = time.monotonic()
            seen = await scrape(server)
            assert time.monotonic() - started < BOUND_S
            assert value(seen, "cluster_generation") == 1
            # Past the address's share, closed at once; the others once silent long enough.
            served = await asyncio.to_thread(still_open, held, 1.0)
            assert len(served) <= CONNECTIONS_PER_ADDRESS
            assert await asyncio.to_thread(still_open, served, REQUEST_S + BOUND_S) == []
            assert serving_threads() <= CONNECTIONS_PER_ADDRESS
        finally:
            for conn in held:
                with contextlib.suppress(OSError):
                    conn.close()
        assert value(await scrape(server), "cluster_generation") == 1


# Addresses enough to hold every slot with their shares.
SLOW_ADDRESSES = [f"127.0.0.{2 + i}" for i in range(CONNECTIONS // CONNECTIONS_PER_ADDRESS)]
TRICKLE_EVERY_S = 0.2  # never silent for long: a per-read timeout never fires
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096


class Trickle:
    """Slow-loris connections to the metrics port: `share` from each of `addresses`, each
    sending its request a byte every TRICKLE_EVERY_S, on a thread of their own. With `again`, a
    connection the server closes is opened again at once (an attacker holding the slots)."""

    def __init__(self, port: int, addresses: list[str], share: int, *, again: bool) -> None:
        self.port, self.again = port, again
        self.started = time.monotonic()
        self.open: dict[socket.socket, tuple[str, int]] = {}
        self.closed_after: list[float] = []  # seconds from the start to each close seen
        for address in addresses:
            for _ in range(share):
                self._connect(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-trickle")
        self._thread.start()

    def _connect(self, address: str) -> None:
        conn = socket.socket()
        conn.settimeout(3.0)
        try:
            conn.bind((address, 0))
            conn.connect(("127.0.0.1", self.port))
        except OSError:
            conn.close()
            return
        conn.setblocking(False)
        self.open[conn] = (address, 0)

    def _run(self) -> None:
        while not self._stop.wait(TRICKLE_EVERY_S):
            for conn, (address, sent) in list(self.open.items()):
                if self._send_one(conn, sent):
                    self.open[conn] = (address, sent + 1)
                    continue
                del self.open[conn]
                conn.close()
                self.closed_after.append(time.monotonic() - self.started)
                if self.again:
                    self._connect(address)

    def _send_one(self, conn: socket.socket, sent: int) -> bool:
        """One more byte of the request; False once the server closed the connection."""
        try:
            if select.select([conn], [], [], 0)[0] and conn.recv(1024) == b"":
                return False
            conn.send(REQUEST[sent % len(REQUEST) : sent % len(REQUEST) + 1])
        except OSError:
            return False
        return True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(BOUND_S)
        for conn in self.open:
            conn.close()


async def test_a_request_trickled_a_byte_at_a_time_is_closed_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never silent, so no read times out: the whole request is due within REQUEST_S
    of the accept all the same."""
    monkeypatch.setattr(bounded_http, "REQUEST_S", 1.0)
    async with SchedulerServer(settings(), observe=ON) as server:
        port = server.observing.metrics_port
        assert port is not None
        trickle = Trickle(port, [OUTSIDER], CONNECTIONS_PER_ADDRESS, again=False)
        try:
            await eventually(
                lambda: not trickle.open, "the trickled connections closed", 1.0 + BOUND_S
            )
        finally:
            trickle.stop()
        assert len(trickle.closed_after) == CONNECTIONS_PER_ADDRESS
        # At the deadline (from the accept, a moment before `started`), not before.
        assert min(trickle.closed_after) >= 1.0 - SWEEP_S


async def test_slow_connections_from_a_few_addresses_keep_no_scrape_out() -> None:
    """Every slot held by connections that trickle their requests, from a few addresses, each
    opened again as soon as it is closed: a scrape from another address still gets in at once
    (it takes the slot of the oldest of an address that holds the most), again and again."""
    async with SchedulerServer(settings(), observe=ON) as server:
        await form(server)
        port = server.observing.metrics_port
        assert port is not None
        trickle = Trickle(port, SLOW_ADDRESSES, CONNECTIONS_PER_ADDRESS, again=True)
        try:
            assert len(trickle.open) == CONNECTIONS  # every slot taken
            for _ in range(3):
                started = time.monotonic()
                assert value(await scrape(server), "cluster_generation") == 1
                assert time.monotonic() - started < 2.0
        finally:
            trickle.stop()
