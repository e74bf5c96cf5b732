"""Why a scheduler cannot be reached: refused, timed out, or taken and dropped (overloaded).

Each case is a real socket on loopback behaving as the failure does: a closed port (refused), a
listener whose accept queue is full (the kernel drops the connection attempt: a timeout), one
that takes connections and never answers (a scheduler out of file descriptors), and one that
takes them and closes them at once.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from cluster.transport import channel
from tests.aio import BOUND_S

HOST = "127.0.0.1"
PROBE_S = 0.5


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind((HOST, 0))
    yield sock
    sock.close()


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


async def why(port: int) -> str:
    reach = await asyncio.wait_for(channel.check_scheduler(HOST, port, None, PROBE_S), BOUND_S)
    assert not reach.ok
    return reach.why


async def test_nothing_listening_is_a_refusal(listener: socket.socket) -> None:
    port = port_of(listener)  # bound, not listening: the kernel refuses
    assert "nothing took the connection (connection refused)" in await why(port)


async def test_a_full_accept_queue_is_a_timeout(listener: socket.socket) -> None:
    listener.listen(0)
    port = port_of(listener)
    # Fill the queue (nobody accepts): further connection attempts go unanswered.
    fillers = []
    for _ in range(8):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex((HOST, port))
        fillers.append(filler)
    try:
        reason = await why(port)
    finally:
        for filler in fillers:
            filler.close()
    assert "(timed out)" in reason, reason
    assert "a firewall or a network partition" in reason


async def test_connections_taken_and_never_answered_are_overload(listener: socket.socket) -> None:
    listener.listen(64)  # the kernel completes connections; nobody answers on them
    reason = await why(port_of(listener))
    assert "accepts connections but did not answer on one within 0.5 s" in reason
    assert "overloaded (out of open files? see its log)" in reason


async def test_connections_dropped_at_once_are_overload() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    server = await asyncio.start_server(drop, HOST, 0)
    try:
        port = server.sockets[0].getsockname()[1]
        reason = await why(port)
    finally:
        server.close()
    assert "it accepts connections, then drops them" in reason
    assert "overloaded" in reason


async def test_a_reachable_scheduler_leaves_no_reason() -> None:
    async def answer_in_http2(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # SETTINGS: not TLS
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer_in_http2, HOST, 0)
    try:
        port = server.sockets[0].getsockname()[1]
        reach = await asyncio.wait_for(channel.check_scheduler(HOST, port, None, PROBE_S), BOUND_S)
    finally:
        server.close()
    assert reach == channel.Reach(ok=True, why="")
