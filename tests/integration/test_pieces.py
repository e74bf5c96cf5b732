"""A member's value in pieces (`edge.pieces`, `ServicerEdge.joined`): a real scheduler takes no
message over `edge.MAX_REQUEST_BYTES`, so a collective's contribution or a key-value set larger
than a piece goes as a client stream of pieces, signed as the request's head (`edge.head`: with a
job secret, the first message names the value's SHA-256). Real agents,
directly and through a host's relay, with and without a job secret; and raw calls of a member
that send what no worker sends."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.protocol.config import Limits
from cluster.scheduler import JobSettings, SchedulerServer
from cluster.tools.relay import Relay, RelaySettings
from cluster.transport import edge
from cluster.transport.membership import call_metadata
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from cluster.worker.agent import WorkerAgent
from tests.aio import BOUND_S, eventually
from tests.credentials import credential, registration
from tests.integration.test_api import make_agent

MIB = 1024 * 1024
SECRET = "a1" * 32


def settings(secret: bytes | None = None) -> JobSettings:
    return JobSettings(
        worker_num=2,
        server_num=0,
        node_timeout_s=30.0,
        topo_timeout_s=60.0,
        heartbeat_interval_s=0.5,
        limits=Limits(kv_max_bytes=8 * MIB),
        job_secret=secret,
    )


def test_a_value_goes_in_pieces_of_at_most_a_message() -> None:
    request = pb.KvSetRequest(key="k", value=bytes(range(256)) * (4 * edge.PIECE_BYTES // 256 + 1))
    pieces = list(edge.pieces(request))
    assert [len(p.value) for p in pieces] == [edge.PIECE_BYTES] * 4 + [256]
    assert (pieces[0].key, pieces[0].value_bytes) == ("k", len(request.value))
    assert all(not p.key for p in pieces[1:])
    assert b"".join(p.value for p in pieces) == request.value
    assert (
        max(p.ByteSize() for p in pieces) <= edge.MESSAGE_LIMITS["KvSet"] <= edge.MAX_REQUEST_BYTES
    )
    small = pb.KvSetRequest(key="k", value=b"v")
    assert list(edge.pieces(small)) == [small]


def test_a_value_calls_proof_covers_the_same_head_whole_as_in_its_first_piece() -> None:
    """What a call proof covers (`edge.head`) is the same in the worker, which signs the whole
    request, and in the scheduler, which has its first message (a first piece, or the whole
    value) and later the request joined; it names the value's SHA-256 and length, and changes
    with any field."""
    for size in (3 * edge.PIECE_BYTES + 5, 7):
        request = pb.KvSetRequest(key="k", value=b"v" * size)
        signed = edge.signed_body("KvSet", request)
        assert request.value_sha256 == hashlib.sha256(request.value).digest()
        first = next(edge.pieces(request))
        assert edge.head(first) == signed
        joined = pb.KvSetRequest(key="k", value=request.value, value_sha256=request.value_sha256)
        assert edge.head(joined) == signed
        assert edge.head(pb.KvSetRequest(key="l", value=request.value)) != edge.head(joined)
    exchange = pb.ExchangeRequest(node_id="0", generation=1, seq=2, value=b"x")
    assert edge.signed_body("Exchange", exchange) != edge.signed_body(
        "Exchange", pb.ExchangeRequest(node_id="0", generation=1, seq=3, value=b"x")
    )
    unary = pb.KvGetRequest(keys=["k"])
    assert edge.signed_body("KvGet", unary) == unary.SerializeToString()


@pytest.mark.parametrize(("path", "secret"), [("direct", None), ("relay", SECRET)])
async def test_values_of_many_pieces_reach_the_scheduler_whole(
    short_dir: Path, path: str, secret: str | None
) -> None:
    """Allgather and broadcast of several MiB, and a key-value set of 3 MiB, come back whole and
    in order: directly without a job secret, and through a relay with one (each call's proof
    covers the request's head, which names the value's SHA-256)."""
    job_secret = None if secret is None else secret.encode()
    async with SchedulerServer(settings(job_secret)) as srv:
        env = {} if secret is None else {"CLUSTER_JOB_SECRET": secret}
        relay = None
        if path == "relay":
            address = f"unix:{short_dir / 'r.sock'}"
            relay = Relay(RelaySettings(address, f"127.0.0.1:{srv.port}", 2, 30.0))
            assert await relay.start() == address
            env["CLUSTER_RELAY"] = address
        try:
            a, b = (make_agent(srv.port, 2, name, **env) for name in "ab")
            if relay is not None:
                assert a._link.route.relay is not None
            await asyncio.wait_for(asyncio.gather(a.start(), b.start()), 20)
            one, two = bytes(range(256)) * (12 * 1024 + 3), b"\xff" * (3 * MIB + 1)
            gathered = await asyncio.wait_for(
                asyncio.gather(a.exchange("allgather", one), b.exchange("allgather", two)), 20
            )
            assert gathered == [[one, two], [one, two]]
            told = await asyncio.wait_for(
                asyncio.gather(a.exchange("broadcast", two), b.exchange("broadcast", b"")), 20
            )
            assert told == [[two], [two]]
            await a.kv_set("big", two)
            assert await b.kv_get(["big"]) == ([two], [])
            await asyncio.gather(a.close(), b.close())
        finally:
            if relay is not None:
                await relay.stop()


@pytest.fixture
async def member() -> AsyncIterator[tuple[SchedulerServer, grpc.aio.Channel]]:
    """A formed job of two registered nodes ("0", "1"), and a channel to its scheduler on which
    calls are made as node 0."""
    async with SchedulerServer(settings()) as srv:
        core = srv.gate.core
        assert core is not None
        for node_id in ("0", "1"):
            await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
        options = [("grpc.max_send_message_length", 128 * MIB)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}", options=options) as channel:
            yield srv, channel


def as_node_0() -> tuple[tuple[str, str], ...]:
    return call_metadata("0", 1, credential("0", 1))


async def kv_set(
    channel: grpc.aio.Channel, messages: Iterator[pb.KvSetRequest]
) -> grpc.aio.AioRpcError:
    """The refusal of a KvSet made of `messages`, as node 0."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await asyncio.wait_for(
            pb_grpc.SchedulerStub(channel).KvSet(messages, metadata=as_node_0()), BOUND_S
        )
    return refused.value


async def kv_set_taken(
    channel: grpc.aio.Channel, value: pb.KvSetRequest
) -> tuple[grpc.aio.AioRpcError, int]:
    """The refusal of a KvSet of `value` in pieces, as node 0, and how many of them gRPC took
    to send (what it sends ahead of a reader, or all of them)."""
    taken = 0

    def counted() -> Iterator[pb.KvSetRequest]:
        nonlocal taken
        for piece in edge.pieces(value):
            taken += 1
            yield piece

    refused = await kv_set(channel, counted())
    return refused, taken


async def test_a_later_message_that_carries_more_than_a_piece_is_refused(
    member: tuple[SchedulerServer, grpc.aio.Channel],
) -> None:
    srv, channel = member
    first = pb.KvSetRequest(key="a", value=b"1", value_bytes=2)
    two_keys = iter([first, pb.KvSetRequest(key="b", value=b"2")])
    refused = await kv_set(channel, two_keys)
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "a later message of a KvSet carries more than a piece" in (refused.details() or "")
    assert ("KvSet", "malformed") in srv.gate.refusals.counts
    got = await pb_grpc.SchedulerStub(channel).KvGet(
        pb.KvGetRequest(keys=["a", "b"]), metadata=as_node_0(), timeout=BOUND_S
    )
    assert list(got.missing) == ["a", "b"]


async def test_a_value_past_the_largest_is_refused_before_the_rest_is_read(
    member: tuple[SchedulerServer, grpc.aio.Channel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its first message names its length: past the largest value (here 4 MiB), the call is
    refused (RESOURCE_EXHAUSTED) once that message came, and the rest is never read; the job
    goes on."""
    monkeypatch.setattr(edge, "MAX_VALUE_BYTES", 4 * MIB)
    srv, channel = member
    refused, sent = await kv_set_taken(channel, pb.KvSetRequest(key="big", value=b"x" * (64 * MIB)))
    # Ended while the caller still writes, gRPC's Python client may say INTERNAL instead (a
    # real worker never sends it: `Calls.request` refuses such a value unsent).
    assert refused.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)
    if refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert "a KvSet value of 67,108,864 bytes (at most 4,194,304)" in (refused.details() or "")
    assert sent < 64, sent  # of 64: what gRPC sends ahead of a reader, not the value
    assert ("KvSet", "oversized") in srv.gate.refusals.counts
    status = await pb_grpc.SchedulerStub(channel).Status(pb.StatusRequest(), timeout=BOUND_S)
    assert status.phase == pb.PHASE_READY


@pytest.mark.parametrize(
    ("named", "said"),
    [(100, "longer than the length it named"), (900, "short of the length it named")],
)
async def test_pieces_that_do_not_make_the_length_named_are_refused(
    member: tuple[SchedulerServer, grpc.aio.Channel], named: int, said: str
) -> None:
    _, channel = member
    messages = [pb.KvSetRequest(key="k", value=b"a" * 90, value_bytes=named)]
    messages.append(pb.KvSetRequest(value=b"b" * 90))
    refused = await kv_set(channel, iter(messages))
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert said in (refused.details() or "")


async def test_a_value_whose_rest_never_comes_is_cut_in_its_time(
    member: tuple[SchedulerServer, grpc.aio.Channel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first piece, then nothing: the call is turned away once `VALUE_WITHIN_S` passed
    (UNAVAILABLE, as one late behind a loaded scheduler: a real node tries again)."""
    monkeypatch.setattr(edge, "VALUE_WITHIN_S", 0.5)
    srv, channel = member
    call = pb_grpc.SchedulerStub(channel).KvSet(metadata=as_node_0())
    value = pb.KvSetRequest(key="late", value=b"x" * (2 * edge.PIECE_BYTES))
    await call.write(next(edge.pieces(value)))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await asyncio.wait_for(call, BOUND_S)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "the rest of a KvSet value did not come within 0.5 s" in (refused.value.details() or "")
    assert ("KvSet", "stalled") in srv.gate.refusals.counts


async def test_a_value_past_the_members_share_is_refused_in_words_not_as_internal(
    member: tuple[SchedulerServer, grpc.aio.Channel],
) -> None:
    """A member's value that would pass its share of bytes in flight (here 64 MiB, another of
    its values of 60 MiB on its way) is refused once its first piece came: the rest is read and
    dropped, so that the worker, still writing, hears RESOURCE_EXHAUSTED and the share's words
    (a call ended under its writes can end as INTERNAL in gRPC's Python client)."""
    _, channel = member
    stub = pb_grpc.SchedulerStub(channel)
    held = stub.KvSet(metadata=as_node_0())
    large = next(edge.pieces(pb.KvSetRequest(key="held", value=b"h" * (60 * MIB))))
    await held.write(large)
    try:
        for _ in range(5):
            value = pb.KvSetRequest(key="more", value=b"m" * (8 * MIB))
            refused = await kv_set(channel, edge.pieces(value))
            assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "a member's share is" in (refused.details() or "")
    finally:
        held.cancel()


async def test_a_standby_refuses_a_members_call_at_its_start_unread(
    member: tuple[SchedulerServer, grpc.aio.Channel],
) -> None:
    """A scheduler that does not lead knows no member: it refuses every member's call at its
    start, naming the leader, and reads none of it. A value of one message, sent as a worker
    sends it (one unary call, `Calls.request`), is refused in words; of a value in pieces gRPC
    sends no more than it sends ahead of a reader (of 64 MiB it read it all and dropped it),
    and the caller, still writing, may hear gRPC's INTERNAL instead (grpc/grpc#36066), which
    a worker takes, as it takes the refusal, for a call cut off: it asks again."""
    srv, channel = member
    await asyncio.wait_for(srv.uninstall(srv.gate.not_leader()), BOUND_S)
    unary = channel.unary_unary(
        "/cluster.v1.Scheduler/KvSet",
        request_serializer=pb.KvSetRequest.SerializeToString,
        response_deserializer=pb.KvSetResponse.FromString,
    )
    value = pb.KvSetRequest(key="k", value=b"v" * edge.PIECE_BYTES)
    for _ in range(5):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(unary(value, metadata=as_node_0()), BOUND_S)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "not the leader" in (refused.value.details() or "")
    large = pb.KvSetRequest(key="k", value=b"v" * (64 * MIB))
    for _ in range(5):
        ended, sent = await kv_set_taken(channel, large)
        assert ended.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
        assert sent < 64, sent  # of 64
    stub = pb_grpc.SchedulerStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.KvGet(pb.KvGetRequest(keys=["k"]), metadata=as_node_0(), timeout=BOUND_S)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_value_whose_first_message_came_after_the_scheduler_stepped_down_is_not_read(
    member: tuple[SchedulerServer, grpc.aio.Channel],
) -> None:
    """A value call that named a member as it started, while the scheduler led, and whose
    first message came once it no longer did, was never admitted: it is refused naming the
    leader with nothing read past that message (a member's admitted call is read to its end
    and dropped, to hear the refusal in words)."""
    srv, channel = member
    servicer = srv.servicer
    assert servicer is not None
    go, sent = asyncio.Event(), 0

    async def held() -> AsyncIterator[pb.KvSetRequest]:
        nonlocal sent
        await go.wait()
        for piece in edge.pieces(pb.KvSetRequest(key="k", value=b"v" * (64 * MIB))):
            sent += 1
            yield piece

    call = pb_grpc.SchedulerStub(channel).KvSet(held(), metadata=as_node_0())
    await eventually(lambda: servicer.arrivals.waiting == 1, "the call to wait for its request")
    await asyncio.wait_for(srv.uninstall(srv.gate.not_leader()), BOUND_S)
    go.set()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await asyncio.wait_for(call, BOUND_S)
    assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
    assert sent < 64, sent  # of 64


@pytest.fixture
async def proven() -> AsyncIterator[tuple[WorkerAgent, pb_grpc.SchedulerStub]]:
    """A formed job with a job secret, of two real agents; a stub of its scheduler on which
    calls are made with agent "a"'s own call proofs."""
    async with SchedulerServer(settings(SECRET.encode())) as srv:
        a, b = (make_agent(srv.port, 2, name, CLUSTER_JOB_SECRET=SECRET) for name in "ab")
        await asyncio.wait_for(asyncio.gather(a.start(), b.start()), 20)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
                yield a, pb_grpc.SchedulerStub(channel)
        finally:
            await asyncio.gather(a.close(), b.close())


async def refused_set(
    stub: pb_grpc.SchedulerStub, request: pb.KvSetRequest, metadata: Any
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await asyncio.wait_for(stub.KvSet(edge.pieces(request), metadata=metadata), BOUND_S)
    return refused.value


async def test_a_value_that_is_not_the_one_its_proof_names_is_refused(
    proven: tuple[WorkerAgent, pb_grpc.SchedulerStub],
) -> None:
    """With a job secret a value call is proven on its first message, whose head names the
    value's SHA-256: a value changed after it was signed (its first piece and proof a
    member's, the rest another's) is refused once whole, and nothing is set."""
    agent, stub = proven
    request = pb.KvSetRequest(key="k", value=b"v" * (2 * edge.PIECE_BYTES))
    metadata = agent._signed("KvSet", request)
    assert len(request.value_sha256) == 32  # named in its first message
    request.value = b"v" * edge.PIECE_BYTES + b"w" * edge.PIECE_BYTES
    refused = await refused_set(stub, request, metadata)
    assert refused.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "a KvSet value whose SHA-256 is not the one its first message named" in (
        refused.details() or ""
    )
    assert await agent.kv_get(["k"]) == ([], ["k"])  # nothing set


async def test_a_value_calls_proof_is_taken_once_as_its_first_message_comes(
    proven: tuple[WorkerAgent, pb_grpc.SchedulerStub],
) -> None:
    """A member's value call made again with the same proof (captured, and replayed) is refused
    at its first message; one whose first message names no SHA-256 of its value is refused
    too (a job secret's proof covers it)."""
    agent, stub = proven
    request = pb.KvSetRequest(key="k", value=b"v" * (2 * edge.PIECE_BYTES))
    metadata = agent._signed("KvSet", request)
    await asyncio.wait_for(stub.KvSet(edge.pieces(request), metadata=metadata), BOUND_S)
    refused = await refused_set(stub, request, metadata)
    assert refused.code() is grpc.StatusCode.UNAUTHENTICATED
    bare = pb.KvSetRequest(key="k", value=b"x")
    assert agent._signer is not None
    refused = await refused_set(stub, bare, agent._signer.metadata("KvSet", edge.head(bare)))
    assert refused.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "names no SHA-256 of its value" in (refused.details() or "")
    assert await agent.kv_get(["k"]) == ([request.value], [])
