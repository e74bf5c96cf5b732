"""What an outsider or a member can make the scheduler hold or answer, over a real channel to a
real scheduler on loopback: a host link whose caller never reads is not read either (what it
holds stays within the link's bounds), and a counter past int64 is refused, not answered with
an error that breaks the key."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from cluster.protocol.errors import CollectiveError
from cluster.scheduler import host_link
from cluster.scheduler.machine.kv import INT64_MAX
from cluster.transport import edge
from cluster.transport.relay import stamp as relay_stamp
from cluster.v1 import scheduler_pb2 as pb
from tests.aio import BOUND_S, eventually
from tests.integration.test_relay import one_member_job

# The outsider's transport takes no more than its first window unread (no window grows by
# bandwidth probes): what it does not read stays with the scheduler's writer.
NO_READ_AHEAD = [("grpc.http2.bdp_probe", 0)]
FLOOD_BATCHES = 100  # 25,600 attaches: three times what a link holds for its writer


async def test_a_host_link_that_is_never_read_holds_its_bound_and_the_job_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches of empty attaches, each refused at once with an end for the writer, and not one
    response read: the scheduler stops reading the link at its bound, so what it holds stays
    within it; the member's KV calls go on meanwhile; once read, every end comes down."""
    links: list[host_link.HostLink] = []

    class Seen(host_link.HostLink):
        def __init__(self, max_slots: int) -> None:
            super().__init__(max_slots)
            links.append(self)

    monkeypatch.setattr(host_link, "HostLink", Seen)
    batch = pb.HostUp(batch=pb.HostUps(ups=[pb.HostUp(attach=pb.HostAttach())] * 256))
    async with (
        one_member_job() as (srv, member),
        grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}", options=NO_READ_AHEAD) as channel,
    ):
        call = channel.stream_stream(
            "/cluster.v1.Scheduler/HostWatch",
            request_serializer=pb.HostUp.SerializeToString,
            response_deserializer=pb.HostDown.FromString,
        )(metadata=relay_stamp())

        async def flood() -> None:
            for _ in range(FLOOD_BATCHES):
                await call.write(batch)
            await call.done_writing()

        writing = asyncio.ensure_future(flood())
        try:
            bound = edge.HOST_SLOTS + edge.HOST_BATCH_UPS  # (a batch's ends past the bound)
            await eventually(
                lambda: bool(links) and (links[0].waiting == 1 or links[0].held()[0] > bound),
                "the link's reader to wait for room",
            )
            link = links[0]
            items, held = link.held()
            assert link.max_pending <= items <= bound
            assert link.waiting == 1
            assert held <= host_link.PENDING_BYTES
            await member.kv_set("k", b"1")  # the job goes on
            assert await member.kv_add("k", 1) == 2
            ended = 0
            while ended < FLOOD_BATCHES * 256:  # read: the link goes on, every end comes down
                down = await asyncio.wait_for(call.read(), BOUND_S)
                ended += len(down.ended)
                assert link.held()[0] <= bound
            await asyncio.wait_for(writing, BOUND_S)
            assert await asyncio.wait_for(call.code(), BOUND_S) == grpc.StatusCode.OK
        finally:
            writing.cancel()
            call.cancel()
        assert srv.core.open_streams == 1  # the member's own


async def test_an_add_past_int64_is_refused_and_the_key_keeps_working() -> None:
    """KvAdd past int64, from an int64 or from a longer number set with KvSet: refused
    FAILED_PRECONDITION, as an add on a value that is no counter is, naming the bounds; the key
    is as it was and takes adds within them afterwards."""
    async with one_member_job() as (_, member):
        stub, signed = member._link.stub, member._signed
        cases = [(str(INT64_MAX).encode(), 1), (b"9" * 30, 1), (b"1", INT64_MAX)]
        for held, amount in cases:
            await member.kv_set("n", held)
            request = pb.KvAddRequest(key="n", amount=amount)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.KvAdd(request, metadata=signed("KvAdd", request), timeout=BOUND_S)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = refused.value.details() or ""
            assert re.search(
                r"key 'n' .*past a counter's bounds \[-9223372036854775808, 9", details
            )
            assert await member.kv_get(["n"]) == ([held], [])
            with pytest.raises(CollectiveError, match="past a counter's bounds"):
                await member.kv_add("n", amount)  # the client's error names it too
        await member.kv_set("n", str(INT64_MAX - 2).encode())
        assert await member.kv_add("n", 2) == INT64_MAX
        assert await member.kv_add("n", -INT64_MAX) == 0
