"""The scheduler's stream mailboxes and its sweep for idle streams, with a fake clock."""

from __future__ import annotations

import asyncio
import collections

from cluster.scheduler.streams import SUPERSEDED, Streams
from tests.conftest import FakeClock


def drain(streams: Streams, key: tuple[str, int]) -> list[object]:
    box = streams.get(key)
    assert box is not None
    got = []
    while box._items:  # the test reads what is queued, without waiting
        got.append(box._items.popleft())
    return got


def test_idle_streams_get_a_heartbeat_and_busy_ones_do_not() -> None:
    clock = FakeClock(0.0)
    streams = Streams(clock)
    streams.open(("a", 1))
    clock.now = 0.5
    streams.open(("b", 1))
    clock.now = 1.0
    streams.idle(1.0, b"hb")  # a has been quiet for 1 s, b for 0.5 s
    assert drain(streams, ("a", 1)) == [b"hb"]
    assert drain(streams, ("b", 1)) == []
    clock.now = 1.5
    streams.put(("b", 1), b"event")  # a message resets b's interval
    clock.now = 2.0
    streams.idle(1.0, b"hb")
    assert drain(streams, ("a", 1)) == [b"hb"]
    assert drain(streams, ("b", 1)) == [b"event"]
    clock.now = 3.0
    streams.broadcast(b"all")
    clock.now = 3.5
    streams.idle(1.0, b"hb")
    assert drain(streams, ("a", 1)) == [b"all"]
    assert drain(streams, ("b", 1)) == [b"all"]


def test_only_the_current_stream_of_a_node_closes_it() -> None:
    streams = Streams(FakeClock(0.0))
    old = streams.open(("a", 1))
    new = streams.open(("a", 1))
    # The old stream ends at once (its reader would otherwise wait on a mailbox nothing is put
    # in: found by the simulation, a registration attempt given up on and arriving late).
    assert old._items == collections.deque([SUPERSEDED])
    assert not streams.close(("a", 1), old)
    assert len(streams) == 1
    assert streams.close(("a", 1), new)
    assert len(streams) == 0


async def test_a_waiting_stream_wakes_on_put() -> None:
    streams = Streams(FakeClock(0.0))
    box = streams.open(("a", 1))
    # Runs once get() has found the mailbox empty and waits.
    asyncio.get_running_loop().call_soon(streams.put, ("a", 1), b"x")
    assert await asyncio.wait_for(box.get(), 5) == b"x"
