"""WatchEvents streams are bounded on an open read side: a real in-process scheduler of a job
without a secret, whose retained events are far more than a stream's flow-control window.
Streams without follow whose readers never read count against CLUSTER_MAX_FOLLOWERS while they
are written, so at most that many hold their events; past it a reader is refused
(RESOURCE_EXHAUSTED, naming the setting), and an honest `mscluster events` reads the job again
once a place is free. A follower ended for falling behind drops what it had waiting."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import grpc
import pytest

from cluster.protocol.config import Limits
from cluster.protocol.errors import SchedulerUnreachableError
from cluster.scheduler import SchedulerServer
from cluster.scheduler.machine.events import Kind, Record
from cluster.tools import events
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.aio import BOUND_S
from tests.scrape import settings

MOST = 3
# 4,096 events of 2 KiB: 8 MiB a stream, more than any window of HTTP/2 flow control.
PADDING = "x" * 2048


async def honest_read(address: str) -> list[str]:
    """`mscluster events --addr`: every retained event, without follow."""
    return [e.kind async for e in events.from_scheduler(address, None, follow=False)]


async def honest_read_soon(address: str) -> list[str]:
    """An honest read, tried until a place is free (the scheduler sees a reader go)."""
    deadline = asyncio.get_running_loop().time() + BOUND_S
    while True:
        try:
            return await honest_read(address)
        except SchedulerUnreachableError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)  # sleep-ok: polls for a free place, bounded above


async def test_streams_whose_readers_never_read_are_capped_and_honest_readers_go_on() -> None:
    job = dataclasses.replace(settings(), limits=Limits(max_followers=MOST))
    async with (
        SchedulerServer(job) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        address = f"127.0.0.1:{server.port}"
        for i in range(4096):
            server.core.journal.emit(Record(Kind.NODES_BACK, {"seconds": i, "pad": PADDING}))
        stub = pb_grpc.SchedulerStub(channel)
        stuck = []
        for _ in range(MOST - 1):
            call = stub.WatchEvents(pb.WatchEventsRequest(follow=False), timeout=4 * BOUND_S)
            await call.read()  # open, then never read again
            stuck.append(call)
        assert len(await honest_read(address)) == 4096  # a place is left: it is read whole
        call = stub.WatchEvents(pb.WatchEventsRequest(follow=False), timeout=4 * BOUND_S)
        await call.read()
        stuck.append(call)
        for follow in (False, True):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.WatchEvents(pb.WatchEventsRequest(follow=follow), timeout=BOUND_S).read()
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "CLUSTER_MAX_FOLLOWERS" in (refused.value.details() or "")
        with pytest.raises(SchedulerUnreachableError, match="CLUSTER_MAX_FOLLOWERS"):
            await honest_read(address)
        stuck.pop().cancel()
        assert len(await honest_read_soon(address)) == 4096
        for call in stuck:
            call.cancel()


async def test_a_follower_ended_for_falling_behind_reads_the_end_without_its_backlog() -> None:
    """A follower whose reader stops reading falls CLUSTER_FOLLOWER_MAX_BYTES behind and is
    ended: what it had waiting (2,000 events) is dropped, so once its reader reads again it
    gets only what gRPC had in flight, then the FellBehindError."""
    async with (
        SchedulerServer(settings()) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        journal = server.core.journal
        call = pb_grpc.SchedulerStub(channel).WatchEvents(
            pb.WatchEventsRequest(after_seq=journal.seq, follow=True), timeout=4 * BOUND_S
        )
        journal.emit(Record(Kind.NODES_BACK, {"seconds": 0}))
        await asyncio.wait_for(call.read(), BOUND_S)  # following; then its reader stops
        sent = 3000  # 6 MiB: past the 4 MiB it may have waiting
        for i in range(sent):
            journal.emit(Record(Kind.NODES_BACK, {"seconds": i, "pad": PADDING}))
            if i % 10 == 0:
                await asyncio.sleep(0)  # sleep-ok: a yield to the loop, which writes the stream
        read, ended = await read_to_its_end(call)
        assert "fell behind" in ended, ended
        assert read < sent // 3, f"{read} events read after the stream fell behind"


async def read_to_its_end(call: Any) -> tuple[int, str]:
    """Every message left in a WatchEvents call: how many, and the details it ended with."""
    read = 0
    try:
        while await asyncio.wait_for(call.read(), BOUND_S) is not grpc.aio.EOF:
            read += 1
    except grpc.aio.AioRpcError as exc:
        return read, exc.details() or ""
    return read, "the stream ended well"
