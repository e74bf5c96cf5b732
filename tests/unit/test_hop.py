"""The local hop between a worker and its relay (`cluster.transport.hop`): a real `HopServer`
on a unix socket and real `HopChannel`s, calls made as the agent makes them. What a grpc.aio
call does, these do: answers, streams, statuses with their details and trailing metadata,
deadlines, cancellation both ways, a connection lost; and what an attacker sends the relay
ends that connection and nothing else."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.protocol.errors import ConfigError
from cluster.transport import failures, hop, names, stub
from cluster.transport.hop import HopContext, HopServer
from cluster.transport.hop_channel import HopChannel
from tests.aio import BOUND_S, eventually

ECHO, SLOW, STREAM, FAILS = "/t/Echo", "/t/Slow", "/t/Stream", "/t/Fails"
BEATS, BROKEN, STUCK, FLOOD = "/t/Beats", "/t/Broken", "/t/Stuck", "/t/Flood"
UPSTREAM = "/t/Upstream"


class Service:
    """Handlers as the relay's: bytes in, bytes out, the context for the rest."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any, float | None]] = []
        self.cancelled: list[str] = []
        self.never = asyncio.Event()
        self.calls_upstream: list[asyncio.Future[bytes]] = []

    def handlers(self) -> dict[str, tuple[str, Any]]:
        return {
            ECHO: ("unary_unary", self.echo),
            SLOW: ("unary_unary", self.slow),
            STREAM: ("unary_stream", self.stream),
            FAILS: ("unary_unary", self.fails),
            BEATS: ("stream_unary", self.beats),
            BROKEN: ("unary_unary", self.broken),
            STUCK: ("stream_unary", self.stuck),
            FLOOD: ("unary_stream", self.flood),
            UPSTREAM: ("unary_unary", self.upstream),
        }

    async def echo(self, request: bytes, context: HopContext) -> bytes:
        self.seen.append(("echo", context.invocation_metadata(), context.time_remaining()))
        return b"echo:" + request

    async def slow(self, request: bytes, context: HopContext) -> bytes:
        try:
            await self.never.wait()
        except asyncio.CancelledError:
            self.cancelled.append("slow")
            raise
        return b""

    async def stream(self, request: bytes, context: HopContext) -> AsyncIterator[bytes]:
        for n in range(int(request)):
            yield str(n).encode()
        if request == b"2":
            context.set_trailing_metadata((("cluster-error", "NotLeaderError"),))
            context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
            context.set_details("stands by")
            return
        try:
            await self.never.wait()
        except asyncio.CancelledError:
            self.cancelled.append("stream")
            raise

    async def fails(self, request: bytes, context: HopContext) -> bytes | None:
        context.set_trailing_metadata((("cluster-error", "CapacityError"), ("x-bin", b"\x00\xff")))
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details("full")
        return None

    async def beats(self, requests: AsyncIterator[bytes], context: HopContext) -> bytes:
        return b"+".join([r async for r in requests])

    async def broken(self, request: bytes, context: HopContext) -> bytes:
        raise KeyError("a bug")

    async def flood(self, request: bytes, context: HopContext) -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"x" * 65536
                await asyncio.sleep(0)  # sleep-ok: a yield to the loop, as a relay's events have
        finally:
            self.cancelled.append("flood")

    async def upstream(self, request: bytes, context: HopContext) -> bytes:
        """Awaits a call of its own, as the relay's handlers await theirs upstream."""
        call: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.calls_upstream.append(call)
        return await call

    async def stuck(self, requests: AsyncIterator[bytes], context: HopContext) -> bytes:
        await self.never.wait()  # reads none of its requests
        return b""


@pytest.fixture
async def served(short_dir: Path) -> AsyncIterator[tuple[Service, str, HopServer]]:
    service = Service()
    server = HopServer(service.handlers())
    path = short_dir / "relay.sock"
    await server.start(str(path))
    try:
        yield service, f"unix:{path}", server
    finally:
        await server.stop()


async def test_answers_statuses_and_metadata_go_both_ways(
    served: tuple[Service, str, HopServer],
) -> None:
    service, address, _ = served
    async with HopChannel(address) as channel:
        assert channel.get_state() is grpc.ChannelConnectivity.IDLE
        echo = channel.unary_unary(ECHO)
        answer = await echo(b"hi", metadata=(("cluster-proof", "abc"),), timeout=30)
        assert answer == b"echo:hi"
        assert channel.get_state() is grpc.ChannelConnectivity.READY
        (_, metadata, remaining) = service.seen[0]
        assert metadata == (("cluster-proof", "abc"),)
        assert remaining is not None
        assert 0 < remaining <= 30
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await channel.unary_unary(FAILS)(b"")
        assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert failed.value.details() == "full"
        assert dict(failed.value.trailing_metadata()) == {
            "cluster-error": "CapacityError",
            "x-bin": b"\x00\xff",
        }
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await channel.unary_unary("/t/Nothing")(b"")
        assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.aio.AioRpcError) as bug:
            await channel.unary_unary(BROKEN)(b"")
        assert bug.value.code() == grpc.StatusCode.UNKNOWN
        assert "KeyError" in (bug.value.details() or "")


async def test_streams_both_ways(served: tuple[Service, str, HopServer]) -> None:
    _, address, _ = served
    async with HopChannel(address) as channel:
        call = channel.unary_stream(STREAM, response_deserializer=bytes.decode)(b"2")
        assert [await call.read(), await call.read()] == ["0", "1"]
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await call.read()
        assert ended.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(await call.trailing_metadata()) == {"cluster-error": "NotLeaderError"}
        beats = channel.stream_unary(BEATS)()
        for beat in (b"a", b"b", b"c"):
            await beats.write(beat)
        await beats.done_writing()
        assert await beats == b"a+b+c"
        with pytest.raises(asyncio.InvalidStateError):
            await beats.write(b"d")


async def test_cancelling_a_call_or_its_deadline_ends_it_at_the_relay(
    served: tuple[Service, str, HopServer],
) -> None:
    service, address, _ = served
    async with HopChannel(address) as channel:
        stream = channel.unary_stream(STREAM)(b"1")
        assert await stream.read() == b"0"
        assert stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stream.read()
        assert await stream.code() == grpc.StatusCode.CANCELLED
        await eventually(lambda: service.cancelled == ["stream"], "the relay's handler cancelled")
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await channel.unary_unary(SLOW)(b"", timeout=0.05)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: "slow" in service.cancelled, "the late call cancelled there")
        # A task cancelled while it awaits its call cancels the call, as in grpc.aio.
        awaiting = asyncio.Event()

        async def answer() -> Any:
            call = channel.unary_unary(SLOW)(b"")
            awaiting.set()
            return await call

        waiting = asyncio.ensure_future(answer())
        await awaiting.wait()
        waiting.cancel()
        await eventually(lambda: service.cancelled.count("slow") == 2, "cancelled there too")


async def test_a_call_whose_call_upstream_is_cancelled_under_it_ends_as_cut_off(
    served: tuple[Service, str, HopServer],
) -> None:
    """The relay closes a channel to the scheduler (for a new one) with calls on it: each is
    cancelled, and the worker's call it served ends UNAVAILABLE, which the worker makes again,
    instead of never ending."""
    service, address, _ = served
    async with HopChannel(address) as channel:
        call = channel.unary_unary(UPSTREAM)(b"")
        await eventually(lambda: len(service.calls_upstream) == 1, "the call made upstream")
        service.calls_upstream[0].cancel()
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await asyncio.wait_for(call, BOUND_S)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "call again" in (cut.value.details() or "")


async def test_a_relay_that_goes_ends_every_call_and_one_that_comes_back_is_found(
    short_dir: Path,
) -> None:
    service = Service()
    path = short_dir / "relay.sock"
    address = f"unix:{path}"
    async with HopChannel(address) as channel:
        # Nobody listens: a call that does not wait for the relay fails at once.
        with pytest.raises(grpc.aio.AioRpcError) as absent:
            await channel.unary_unary(ECHO)(b"x")
        assert absent.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "does not answer" in (absent.value.details() or "")
        # One that waits for it is answered once the relay listens.
        waiting = asyncio.ensure_future(
            channel.unary_unary(ECHO)(b"x", wait_for_ready=True, timeout=BOUND_S)
        )
        server = HopServer(service.handlers())
        await server.start(str(path))
        assert await asyncio.wait_for(waiting, BOUND_S) == b"echo:x"
        stream = channel.unary_stream(STREAM)(b"1")
        assert await stream.read() == b"0"
        await server.stop()
        with pytest.raises(grpc.aio.AioRpcError) as lost:
            await asyncio.wait_for(stream.read(), BOUND_S)
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        assert channel.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE
        again = HopServer(service.handlers())
        await again.start(str(path))
        try:
            assert await channel.unary_unary(ECHO)(b"y", wait_for_ready=True) == b"echo:y"
        finally:
            await again.stop()


async def test_closing_the_channel_cancels_its_calls_here_and_at_the_relay(
    served: tuple[Service, str, HopServer],
) -> None:
    service, address, _ = served
    channel = HopChannel(address)
    call = channel.unary_unary(SLOW)(b"")
    await eventually(lambda: channel._calls != {}, "the call started")
    await channel.close(grace=None)
    with pytest.raises(asyncio.CancelledError):
        await call
    await eventually(lambda: service.cancelled == ["slow"], "the relay's handler cancelled")
    with pytest.raises(grpc.aio.UsageError):
        channel.unary_unary(ECHO)(b"")
    # With a grace: a call that ends within it ends as it would; one still open then is cancelled.
    graced = HopChannel(address)
    answered = graced.unary_unary(ECHO)(b"g")
    held = graced.unary_unary(SLOW)(b"")
    await graced.close(grace=0.2)
    assert await answered == b"echo:g"
    assert held.cancelled()


def raw_connection(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(BOUND_S)
    sock.connect(address.removeprefix("unix:"))
    return sock


@pytest.mark.parametrize(
    "sent",
    [
        b"\x00\x00\x00\x05junk!",  # a frame that is no HopUp
        struct.pack(">I", hop.MAX_FRAME_BYTES + 1),  # a frame too long to take
        b"\x00\x00\x00\x02\x08\x01",  # a HopUp that carries nothing
        b"\x00\x00",  # a frame cut short
    ],
    ids=["garbage", "oversized", "empty", "cut"],
)
async def test_what_is_no_frame_ends_that_connection_and_nothing_else(
    served: tuple[Service, str, HopServer], sent: bytes
) -> None:
    _, address, _ = served
    async with HopChannel(address) as channel:
        stream = channel.unary_stream(STREAM)(b"1")
        assert await stream.read() == b"0"
        loop = asyncio.get_running_loop()
        sock = raw_connection(address)
        try:
            await loop.run_in_executor(None, sock.sendall, sent)
            await loop.run_in_executor(None, sock.shutdown, socket.SHUT_WR)
            assert await loop.run_in_executor(None, sock.recv, 1) == b""  # closed by the relay
        finally:
            sock.close()
        assert not stream.done()  # the worker's call goes on
        assert await channel.unary_unary(ECHO)(b"z") == b"echo:z"


async def test_a_call_number_used_twice_or_too_many_calls_are_refused(
    served: tuple[Service, str, HopServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, address, _ = served
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(hop, "MAX_CALLS", 2)
    async with HopChannel(address) as channel:
        held = [channel.unary_unary(SLOW)(b"") for _ in range(2)]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_unary(SLOW)(b"")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in held:
            call.cancel()
    # Requests written far ahead of a handler that reads none: that connection is closed.
    flood = [stub.hop_start(1, STUCK, (), None, None)]
    flood += [stub.hop_request(1, b"beat")] * (hop.READ_AHEAD + 2)
    sock = raw_connection(address)
    try:
        await loop.run_in_executor(None, sock.sendall, b"".join(map(hop.frame, flood)))
        assert await loop.run_in_executor(None, sock.recv, 65536) == b""
    finally:
        sock.close()
    # A call number started twice on one connection: that connection is closed.
    start = stub.hop_start(7, SLOW, (), None, b"x")
    sock = raw_connection(address)
    try:
        await loop.run_in_executor(None, sock.sendall, hop.frame(start) * 2)
        assert await loop.run_in_executor(None, sock.recv, 65536) == b""
    finally:
        sock.close()
    async with HopChannel(address) as channel:
        assert await channel.unary_unary(ECHO)(b"w") == b"echo:w"


async def test_a_relay_that_stops_answering_is_left_and_one_that_answers_is_kept(
    served: tuple[Service, str, HopServer], short_dir: Path
) -> None:
    """A stopped relay (its socket accepts, its process answers nothing) is found by the
    channel's pings within MS_NODE_TIMEOUT, 1 s of slack and a ping's interval: its calls end
    UNAVAILABLE. A relay that answers the pings keeps the calls open past that."""
    _, address, _ = served
    async with HopChannel(address, silence_s=0.2) as channel:
        stream = channel.unary_stream(STREAM)(b"1")
        assert await stream.read() == b"0"
        with pytest.raises(TimeoutError):  # nothing more comes, and the call stays open
            await asyncio.wait_for(asyncio.shield(stream.read()), 2.5)
        assert not stream.done()
    frozen = asyncio.Event()

    async def stopped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await frozen.wait()  # reads nothing, answers nothing
        writer.close()

    path = short_dir / "stopped.sock"
    server = await asyncio.start_unix_server(stopped, str(path))
    try:
        async with HopChannel(f"unix:{path}", silence_s=0.2) as channel:
            call = channel.unary_stream(STREAM)(b"1")
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await asyncio.wait_for(call.read(), BOUND_S)
            assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "did not answer for" in (gone.value.details() or "")
    finally:
        frozen.set()
        server.close()


async def test_a_worker_that_reads_nothing_is_dropped(
    served: tuple[Service, str, HopServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that stops reading its answers (its process hung while the relay has events
    for it) holds at most MAX_UNREAD_BYTES of the relay's memory: then its connection is closed
    and its calls end there."""
    service, address, _ = served
    monkeypatch.setattr(hop, "MAX_UNREAD_BYTES", 1024 * 1024)
    sock = raw_connection(address)
    try:
        start = hop.frame(stub.hop_start(1, FLOOD, (), None, b""))
        await asyncio.get_running_loop().run_in_executor(None, sock.sendall, start)
        await eventually(lambda: service.cancelled == ["flood"], "the flood stopped", BOUND_S)
    finally:
        sock.close()
    async with HopChannel(address) as channel:
        assert await channel.unary_unary(ECHO)(b"v") == b"echo:v"


async def test_a_relay_serves_only_the_workers_of_its_schedulers(short_dir: Path) -> None:
    """A relay with its job's schedulers (a standby among them) ends the call of a worker for
    none of them (another job's, its CLUSTER_RELAY pointed here), or of one that names none, with
    FAILED_PRECONDITION: a ConfigError whose line names this relay, both lists and what to do,
    reaching no handler; said in the relay's log once per list. A worker for any of them (the
    standby, a host spelt in other case) is served. (Names of a hosts table of the test's own,
    `hosts`: what a resolver answers for names made up is the machine's.)"""
    service, said = Service(), []
    lookup = hosts({"leader": {"10.0.0.1"}, "standby": {"10.0.0.2"}})
    server = HopServer(service.handlers(), ["Leader:1", "standby:2"], said.append, lookup)
    path = short_dir / "relay.sock"
    await server.start(str(path))
    try:
        for theirs in (["other:1", "other:2"], ["other:1", "other:2"], []):
            async with HopChannel(f"unix:{path}", schedulers=theirs) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await channel.unary_unary(ECHO)(b"hi")
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = refused.value.details() or ""
            assert f"the relay at unix:{path} (CLUSTER_RELAY)" in details
            assert "forwards to the schedulers at Leader:1, standby:2" in details
            error = failures.failure_of(refused.value).error("registering")
            assert type(error) is ConfigError
            assert str(error) == details
            if theirs:
                assert "this worker is for the schedulers at other:1, other:2" in details
                assert "Point CLUSTER_RELAY at this job's relay, or unset it" in details
            else:
                assert "does not say which scheduler it is for" in details
        assert service.seen == []
        resolved = "leader is 10.0.0.1; standby is 10.0.0.2"
        assert said == [
            "refused a worker's calls (the schedulers at other:1, other:2): this relay forwards "
            f"to the schedulers at Leader:1, standby:2 (resolved here: {resolved}; other does "
            "not resolve (Name or service not known))",
            "refused a worker's calls (no scheduler named): this relay forwards to the "
            f"schedulers at Leader:1, standby:2 (resolved here: {resolved})",
        ]
        for ours in (["other:1", "standby:2"], ["leader:1"]):
            async with HopChannel(f"unix:{path}", schedulers=ours) as channel:
                assert await channel.unary_unary(ECHO)(b"hi") == b"echo:hi"
        assert len(service.seen) == 2
    finally:
        await server.stop()


def hosts(table: dict[str, set[str]]) -> Callable[[str], frozenset[str]]:
    """A resolver of the names in `table` (the others: not known, as a resolver says it)."""

    def lookup(name: str) -> frozenset[str]:
        if name not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return frozenset(table[name])

    return lookup


async def test_a_relay_serves_its_schedulers_workers_however_each_spells_them(
    short_dir: Path,
) -> None:
    """A relay given `localhost:PORT` (looked up by this machine's resolver) serves a worker
    given `127.0.0.1:PORT`, `LOCALHOST.:0PORT` or `[::ffff:127.0.0.1]:PORT`; a worker for
    another port is refused with both lists as written and what localhost resolved to."""
    try:
        local = {info[4][0] for info in socket.getaddrinfo("localhost", None)}
    except OSError:
        local = set()
    if "127.0.0.1" not in local:
        pytest.skip("localhost does not resolve to 127.0.0.1 here")
    service, said = Service(), []
    server = HopServer(service.handlers(), ["localhost:7000"], said.append)
    path = short_dir / "relay.sock"
    await server.start(str(path))
    try:
        for ours in (["127.0.0.1:7000"], ["LOCALHOST.:07000"], ["[::ffff:127.0.0.1]:7000"]):
            async with HopChannel(f"unix:{path}", schedulers=ours) as channel:
                assert await channel.unary_unary(ECHO)(b"hi") == b"echo:hi"
        assert len(service.seen) == 3
        async with HopChannel(f"unix:{path}", schedulers=["127.0.0.1:7001"]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary(ECHO)(b"hi")
        details = refused.value.details() or ""
        assert "this worker is for the scheduler at 127.0.0.1:7001" in details, details
        forwards = "forwards to the scheduler at localhost:7000 (resolved here: localhost is "
        assert forwards in details, details
        assert "127.0.0.1" in details.split("resolved here:")[1]
        assert len(service.seen) == 3
        assert len(said) == 1
    finally:
        await server.stop()


async def test_a_lookup_that_hangs_stalls_neither_the_relay_nor_its_other_workers(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's name whose lookup never answers (a resolver hung: `hosts` that waits) keeps
    its call waiting at most LOOKUP_S, then refuses it saying so; meanwhile the relay serves a
    worker that names its scheduler as it does, and the next call of the hung name's worker
    waits on the same lookup, not on a second one."""
    monkeypatch.setattr(names, "LOOKUP_S", 0.3)
    release, asked = threading.Event(), []

    def hung(name: str) -> frozenset[str]:
        asked.append(name)
        release.wait(BOUND_S)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    service = Service()
    server = HopServer(service.handlers(), ["10.0.0.1:7000"], lookup=hung)
    path = short_dir / "relay.sock"
    await server.start(str(path))
    try:
        async with HopChannel(f"unix:{path}", schedulers=["sched.example:7000"]) as slow:
            waiting = asyncio.ensure_future(slow.unary_unary(ECHO)(b"slow"))
            async with HopChannel(f"unix:{path}", schedulers=["10.0.0.1:7000"]) as fast:
                assert await fast.unary_unary(ECHO)(b"hi") == b"echo:hi"
            assert not waiting.done()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(waiting, BOUND_S)
            details = refused.value.details() or ""
            assert "(resolved here: sched.example does not resolve (no answer within 0.3 s))" in (
                details
            ), details
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.wait_for(slow.unary_unary(ECHO)(b"again"), BOUND_S)
        assert asked == ["sched.example"]
        assert len(service.seen) == 1  # the other worker's call only
    finally:
        release.set()
        await server.stop()
