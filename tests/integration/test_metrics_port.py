"""The scheduler's metrics port against whoever reaches it: a real scheduler serving /metrics on
loopback, and a caller from another loopback address (127.0.0.2) that opens hundreds of
connections and sends nothing on them. They hold a bounded number of the server's threads, each
for at most METRICS_IDLE_S, the rest are closed at once, and a real scrape gets through while
they are open."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

from cluster.scheduler import SchedulerServer
from cluster.scheduler.metrics import METRICS_CONNECTIONS_PER_ADDRESS, METRICS_IDLE_S
from tests.aio import BOUND_S
from tests.scrape import ON, form, scrape, settings, value

IDLE_CONNECTIONS = 400
OUTSIDER = "127.0.0.2"


def open_idle(port: int, count: int) -> list[socket.socket]:
    """Up to `count` connections from OUTSIDER to the metrics port that send nothing (it stops
    at the first connection the port does not take within 3 s)."""
    held = []
    for _ in range(count):
        conn = socket.socket()
        conn.settimeout(3.0)  # a dropped SYN is sent again after 1 s
        try:
            conn.bind((OUTSIDER, 0))
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
            assert serving_threads() <= METRICS_CONNECTIONS_PER_ADDRESS
            started = time.monotonic()
            seen = await scrape(server)
            assert time.monotonic() - started < BOUND_S
            assert value(seen, "cluster_generation") == 1
            # Past the address's share, closed at once; the others once silent long enough.
            served = await asyncio.to_thread(still_open, held, 1.0)
            assert len(served) <= METRICS_CONNECTIONS_PER_ADDRESS
            assert await asyncio.to_thread(still_open, served, METRICS_IDLE_S + BOUND_S) == []
            assert serving_threads() <= METRICS_CONNECTIONS_PER_ADDRESS
        finally:
            for conn in held:
                with contextlib.suppress(OSError):
                    conn.close()
        assert value(await scrape(server), "cluster_generation") == 1
