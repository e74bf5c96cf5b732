"""An outsider's request streams (Heartbeat, HostBeats, HostWatch) that send nothing are cut at
the first-message deadline, or turned away past their address's share of calls waiting; host
calls whose messages speak for nobody (an empty batch of beats, a detach of no slot) are held to
a few per address. The scheduler's held calls stay bounded, and a relay's job goes on beside
them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from cluster.scheduler import SchedulerServer
from cluster.tools.relay import Relay, RelaySettings
from cluster.transport import edge
from cluster.transport.relay import stamp as relay_stamp
from cluster.v1 import scheduler_pb2 as pb
from tests.aio import eventually
from tests.integration.test_relay import make_agent, settings

SERVICE = "/cluster.v1.Scheduler/"
SILENT = 300  # calls of each method: 900 in all, past the 512 one address may have waiting
NOBODY = 40  # host calls of each kind whose one message speaks for nobody
CALL_S = edge.FIRST_MESSAGE_S + 25  # the outsider's own bound: past it, the scheduler held on
CROWDED = "try again"


async def status(call: Any) -> str:
    """How a call ended: its code and details."""
    return f"{(await call.code()).name}: {await call.details()}"


async def silent_calls(port: int, count: int) -> list[str]:
    """`count` calls of each request-streaming method on one connection, none of which sends
    a message (the streams stay open, pings answered); how each ended."""
    never = asyncio.Event()

    async def no_request() -> AsyncIterator[bytes]:
        await never.wait()  # the stall itself: no message, ever
        yield b""

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        calls = [
            make(SERVICE + method, request_serializer=bytes, response_deserializer=bytes)(
                no_request(), timeout=CALL_S, metadata=relay_stamp()
            )
            for method, make in (
                ("Heartbeat", channel.stream_unary),
                ("HostBeats", channel.stream_unary),
                ("HostWatch", channel.stream_stream),
            )
            for _ in range(count)
        ]
        results = await asyncio.gather(*(status(call) for call in calls))
        never.set()
    return results


async def speaking_for_nobody(channel: grpc.aio.Channel) -> list[Any]:
    """`NOBODY` HostBeats calls that send an empty batch and `NOBODY` HostWatch calls that send
    a detach of a slot they never attached, each then silent (left open)."""
    beats = channel.stream_unary(
        SERVICE + "HostBeats",
        request_serializer=pb.HostBeatsRequest.SerializeToString,
        response_deserializer=pb.HostBeatsResponse.FromString,
    )
    link = channel.stream_stream(
        SERVICE + "HostWatch",
        request_serializer=pb.HostUp.SerializeToString,
        response_deserializer=pb.HostDown.FromString,
    )
    calls: list[Any] = []
    for make, message in ((beats, pb.HostBeatsRequest()), (link, pb.HostUp(detach=7))):
        for _ in range(NOBODY):
            call = make(metadata=relay_stamp())
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await asyncio.wait_for(call.write(message), 10)
            calls.append(call)
    return calls


async def test_silent_streams_end_and_host_calls_for_nobody_are_held_to_a_share(
    short_dir: Path,
) -> None:
    async with SchedulerServer(settings(2)) as srv:
        servicer = srv.servicer
        assert servicer is not None
        address = f"unix:{short_dir / 'r.sock'}"
        relay = Relay(RelaySettings(address, f"127.0.0.1:{srv.port}", 2, 30.0))
        await relay.start()
        agents = [make_agent(srv.port, 2, n, [], CLUSTER_RELAY=address) for n in "ab"]
        try:
            await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 20)
            # The relay's HostWatch and HostBeats, on its members' connection.
            await eventually(lambda: servicer.host_calls.held == 2, "the relay's host calls", 10)

            flood = asyncio.ensure_future(silent_calls(srv.port, SILENT))
            most = 0

            def over() -> bool:
                nonlocal most
                most = max(most, servicer.arrivals.waiting)
                return flood.done()

            await eventually(over, "the silent calls' ends", CALL_S + 10)
            results = flood.result()
            crowded = [r for r in results if r.startswith("UNAVAILABLE") and CROWDED in r]
            cut = [r for r in results if f"no request within {edge.FIRST_MESSAGE_S:g} s" in r]
            assert len(crowded) + len(cut) == 3 * SILENT, sorted(set(results))[:5]
            assert len(crowded) >= 3 * SILENT - edge.ARRIVALS_PER_PEER
            assert 0 < most <= edge.ARRIVALS_PER_PEER
            assert servicer.arrivals.waiting == 0
            assert servicer.host_calls.held == 2
            print(f"SILENT crowded={len(crowded)} cut={len(cut)} most_waiting={most}")

            async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
                calls = await speaking_for_nobody(channel)
                turned = 2 * NOBODY - edge.HOST_CALLS_PER_PEER
                await eventually(
                    lambda: sum(call.done() for call in calls) == turned, "the calls past the share"
                )
                ended = [await status(call) for call in calls if call.done()]
                assert all(e.startswith("UNAVAILABLE") and CROWDED in e for e in ended), ended[:3]
                assert servicer.host_calls.memberless("127.0.0.1") == edge.HOST_CALLS_PER_PEER
                assert servicer.host_calls.held == 2 + edge.HOST_CALLS_PER_PEER
                # The relay's job goes on beside them: its collective, and its beats.
                members = srv.core.state.members
                seen = {n: members[n].last_seen for n in "ab"}
                gathers = (a.exchange("allgather", n.encode()) for a, n in zip(agents, "ab"))
                assert await asyncio.wait_for(asyncio.gather(*gathers), 10) == [[b"a", b"b"]] * 2
                await eventually(
                    lambda: all(members[n].last_seen != seen[n] for n in "ab"), "relayed beats"
                )
                for call in calls:
                    call.cancel()
            await eventually(lambda: servicer.host_calls.held == 2, "the outsider's calls gone")
            await asyncio.gather(*(a.close() for a in agents))
        finally:
            await relay.stop()
