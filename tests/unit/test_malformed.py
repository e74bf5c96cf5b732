"""Bytes that are not a request, sent to a real scheduler and a real state server (grpc.aio on
loopback): refused as INVALID_ARGUMENT at the edge, counted like any refusal, and the server
goes on. gRPC, left to parse them, answers UNKNOWN with the parser's exception; the fuzzer at
the edge (tests/integration/test_fuzz.py) found it with its first random body."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cluster.protocol import auth, peer_state
from cluster.scheduler import SchedulerServer
from cluster.scheduler.wiring import MEMBER_CALLS
from cluster.storage.served import ServedCheckpoints
from cluster.transport import edge, relay
from cluster.v1 import peer_state_pb2 as ps
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from cluster.worker.session import BackgroundLoop
from cluster.worker.state_server import StateServer
from tests.aio import BOUND_S
from tests.scrape import settings

GARBAGE = b"\xff\xff\xff"  # a field tag with no end: no message parses it
STREAMS = ("Watch", "WatchEvents")


def _raw(data: bytes) -> bytes:
    return data


def test_bytes_that_do_not_parse_are_malformed_not_an_exception() -> None:
    parse = edge.capped("KvGet", pb.KvGetRequest.FromString)
    found = parse(GARBAGE)
    assert isinstance(found, edge.Malformed)
    assert isinstance(found, edge.Unparsed)
    assert found.message() == (
        "a KvGet request of 3 bytes that is not one (is the caller a node of this version of "
        "cluster?)"
    )
    assert parse(pb.KvGetRequest(keys=["k"]).SerializeToString()) == pb.KvGetRequest(keys=["k"])


async def _send(channel: grpc.aio.Channel, method: str) -> None:
    """GARBAGE as the request of `method` (each beat of a Heartbeat stream), stamped with this
    release as a host's relay stamps its calls (HostBeats, HostWatch)."""
    path = f"/cluster.v1.Scheduler/{method}"
    stamped = {"timeout": BOUND_S, "metadata": relay.stamp()}
    if method in STREAMS:
        async for _ in channel.unary_stream(path, _raw, _raw)(GARBAGE, **stamped):
            pass
    elif method == "Heartbeat":
        await channel.stream_unary(path, _raw, _raw)(iter([GARBAGE]), **stamped)
    else:
        await channel.unary_unary(path, _raw, _raw)(GARBAGE, **stamped)


async def _ends(channel: grpc.aio.Channel, method: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _send(channel, method)
    return info.value


async def test_every_method_of_the_scheduler_refuses_bytes_that_are_not_its_request() -> None:
    """A member's method, called by a caller that names no node, is refused before its bytes
    are read (`ServicerEdge.named`): UNAUTHENTICATED, counted as such."""
    methods = list(edge.MESSAGE_LIMITS)
    async with SchedulerServer(settings()) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for method in methods:
                refused = await _ends(channel, method)
                if method in MEMBER_CALLS:
                    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, (method, refused)
                    assert f"a {method} call that names no node" in str(refused.details())
                    continue
                assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, refused)
                assert f"a {method} request of 3 bytes that is not one" in str(refused.details())
            stub = pb_grpc.SchedulerStub(channel)
            status = await stub.Status(pb.StatusRequest(), timeout=BOUND_S)
        assert status.worker_num == 2  # still answering
        counts = server.gate.refusals.counts
        assert counts == {
            (method, "unauthenticated" if method in MEMBER_CALLS else "malformed"): 1
            for method in methods
        }


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    loop = BackgroundLoop("test-malformed")
    yield loop
    loop.stop()


def test_the_state_server_refuses_bytes_that_are_not_a_fetch_request(
    loop: BackgroundLoop, tmp_path: Path
) -> None:
    server = StateServer("127.0.0.1", 2)
    server.offer(ServedCheckpoints(tmp_path, "net", 0))
    loop.run(server.start(), timeout_s=BOUND_S)
    try:
        with grpc.insecure_channel(server.published.address) as channel:
            fetch = channel.unary_stream("/cluster.v1.PeerState/Fetch", _raw, _raw)
            with pytest.raises(grpc.RpcError) as info:
                list(fetch(GARBAGE, timeout=BOUND_S))
            refused = info.value
            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert "not a FetchRequest" in str(refused.details())  # type: ignore[attr-defined]
            # A member's request is still taken (this server holds no step 1: not found).
            nonce = auth.new_nonce()
            proof = peer_state.Request("net", 0, 1, False).prove(server.token, nonce)
            good = ps.FetchRequest(prefix="net", rank=0, step=1, nonce=nonce, proof=proof)
            with pytest.raises(grpc.RpcError) as info:
                list(fetch(good.SerializeToString(), timeout=BOUND_S))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        assert server.refused == {"INVALID_ARGUMENT": 1, "NOT_FOUND": 1}
    finally:
        loop.run(server.stop(0), timeout_s=BOUND_S)
