"""A node's Heartbeat call under a job secret, against a real scheduler (grpc.aio on loopback):
its call proof is taken once, at the first beat, and every later beat of the same call counts
for the same node. Before, each beat was admitted with the call's one proof, so the second was
refused as a replay and ended the stream: a worker kept only every other beat (it opens a new
stream at the next), and a client that keeps one stream (the fuzzer's member) went silent and
was dropped. Found by tests/integration/test_fuzz.py."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest

from cluster.scheduler import SchedulerServer
from cluster.transport import membership
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.aio import BOUND_S
from tests.credentials import credential
from tests.scrape import settings
from tests.unit.test_state import reg

SECRET = b"the job's secret"


async def _beats(node_id: str, count: int) -> AsyncIterator[pb.HeartbeatRequest]:
    for _ in range(count):
        yield pb.HeartbeatRequest(node_id=node_id, incarnation=1)


async def test_every_beat_of_one_heartbeat_call_counts_and_only_for_its_node() -> None:
    async with SchedulerServer(dataclasses.replace(settings(), job_secret=SECRET)) as server:
        core = server.core
        for node_id in ("0", "1"):
            await asyncio.wait_for(core.register(reg(core.state, node_id)), BOUND_S)
        signer = membership.CallSigner(SECRET, "0", 1, credential("0", 1))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.SchedulerStub(channel)
            metadata = signer.metadata("Heartbeat", b"")
            answer = await stub.Heartbeat(_beats("0", 5), timeout=BOUND_S, metadata=metadata)
            assert answer == pb.HeartbeatResponse()

            # The same call cannot beat for another node: node 1 is admitted with node 0's
            # proof, which fails.
            async def both() -> AsyncIterator[pb.HeartbeatRequest]:
                yield pb.HeartbeatRequest(node_id="0", incarnation=1)
                yield pb.HeartbeatRequest(node_id="1", incarnation=1)

            metadata = signer.metadata("Heartbeat", b"")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Heartbeat(both(), timeout=BOUND_S, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
