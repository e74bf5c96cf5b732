"""A host's relay among standbys: it follows a leader a standby names only when that leader runs
its workers' job, and it keeps a channel only to the scheduler it follows (and, while the calls
on it end, the one it left). Real schedulers (`SchedulerServer`), and standbys played by
grpc.aio servers on loopback that answer every call as a standby does, naming a leader."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.protocol.errors import ClusterError, NotLeaderError
from cluster.scheduler import SchedulerServer
from cluster.tools import relay as relay_tool
from cluster.tools.relay import Relay, RelaySettings
from cluster.transport import channel, failures, stub
from cluster.transport import upstreams as upstreams_module
from cluster.transport.upstreams import Upstreams
from cluster.v1 import scheduler_pb2 as pb
from tests.aio import eventually
from tests.integration.test_relay import make_agent, settings
from tests.sockets import established


def _standby_handlers(leader: Callable[[], str]) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """Every method of the scheduler's service, answered as a standby whose leader is at
    `leader()`: a registration refused naming it, every other call ended NotLeaderError, a
    Challenge answered with no job (`cluster.scheduler.servicer`)."""

    async def challenge(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return pb.ChallengeResponse().SerializeToString()

    async def watch(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        named = leader()
        refused = pb.Refusal(reason=pb.REFUSAL_NOT_LEADER, leader=named, retry_after_s=0.5)
        context.set_trailing_metadata(((failures.LEADER_KEY, named),))
        yield pb.Event(refused=refused).SerializeToString()

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        code, trailing = failures.status_of(NotLeaderError("a standby", leader()))
        await context.abort(code, "this scheduler stands by", trailing)
        return b""  # pragma: no cover - aborted before

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await refuse(request, context)
        yield b""  # pragma: no cover - aborted before

    made: dict[str, Callable[..., Any]] = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for name, (kind, _path, _options) in stub.methods().items():
        answer: Any = refuse_stream if kind.endswith("_stream") else refuse
        if name == "Challenge":
            answer = challenge
        elif name == "Watch":
            answer = watch
        handlers[name] = made[kind](answer)
    return handlers


@contextlib.asynccontextmanager
async def standbys(leaders: list[str]) -> AsyncIterator[list[str]]:
    """One standby on a loopback port 0 for each of `leaders`, naming it (a leader "+1": the
    next standby, the last the first): their addresses."""
    servers, addresses = [], []
    for _ in leaders:
        servers.append(grpc.aio.server())
        addresses.append(f"127.0.0.1:{servers[-1].add_insecure_port('127.0.0.1:0')}")
    for i, (server, leader) in enumerate(zip(servers, leaders, strict=True)):
        named = addresses[(i + 1) % len(addresses)] if leader == "+1" else leader
        handlers = _standby_handlers(lambda named=named: named)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("cluster.v1.Scheduler", handlers),)
        )
        await server.start()
    try:
        yield addresses
    finally:
        for server in servers:
            await server.stop(None)


async def test_a_relay_follows_no_leader_of_another_job_and_its_workers_stay_off_it(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay and its workers know two schedulers: their job's, and a standby of another
    job's (started on that job's state, or left from it), which names that job's leader. A
    worker formed the job through the relay; its scheduler then goes. The relay moves to the
    standby, which names the other job's leader: the relay asks that leader which job it runs,
    does not follow it, and says so naming both jobs. A fresh worker (no job of its own yet)
    registering through it meanwhile is not taken into the other job, and no worker is told
    to follow that leader. (The relay followed any leader named: the fresh worker joined the
    other job.)"""
    async with SchedulerServer(settings(1)) as ours, SchedulerServer(settings(1)) as theirs:
        elsewhere = f"127.0.0.1:{theirs.port}"
        async with standbys([elsewhere]) as (standby,):
            address = f"unix:{short_dir / 'r.sock'}"
            home = f"127.0.0.1:{ours.port}"
            lines: list[str] = []
            monkeypatch.setattr(relay_tool, "_say", lines.append)
            relay = Relay(RelaySettings(address, home, 1, 30.0, others=(standby,)))
            await relay.start()
            env = {"CLUSTER_RELAY": address, "CLUSTER_SCHED_ADDRS": f"{home},{standby}"}
            said: list[str] = []
            try:
                first = make_agent(ours.port, 1, "a", said, **env)
                await first.start()
                job, other = ours.core.state.cluster_id, theirs.core.state.cluster_id
                await ours.stop()
                line = (
                    f"not following the leader at {elsewhere} that the scheduler at {standby} "
                    f"names: it runs job {other}, and this relay's workers are in job {job}"
                )
                fresh = make_agent(ours.port, 1, "b", said, MS_TOPO_TIMEOUT="3", **env)
                with pytest.raises(ClusterError):
                    await fresh.start()
                assert theirs.core.state.members == {}, theirs.core.state.members
                assert any(x.startswith(line) for x in lines), lines
                assert not any(elsewhere in s for s in said), said
                upstreams = relay._channel
                assert isinstance(upstreams, Upstreams)
                assert elsewhere not in upstreams.held
                assert sum("not following" in x for x in lines) == 1, lines
                await first.close()
                await fresh.close()
            finally:
                await relay.stop()


def _connections_to(addresses: list[str]) -> int:
    """How many TCP connections this process holds to `addresses` (host:port)."""
    ports = {int(a.rpartition(":")[2]) for a in addresses}
    return sum(1 for _, remote in established(os.getpid()) if _port(remote) in ports)


def _port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


async def test_a_relay_keeps_no_channel_to_a_scheduler_it_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three standbys, each naming the next as the leader (a leadership that moves on while
    the relay follows it): the relay follows each in turn, round twice. It holds a channel (and
    its connection) to the one it follows, and to the one it left last for LEAVING_S, not to
    every one it ever followed. (It kept a channel, and its connection, to each.)"""
    monkeypatch.setattr(upstreams_module, "LEAVING_S", 0.5)
    async with standbys(["+1", "+1", "+1"]) as names:
        options = channel.keepalive_options(30.0)
        upstreams = Upstreams(names[:1], lambda a: channel.open_channel(a, None, options))
        path = stub.methods()["KvGet"][1]
        try:
            for hop in range(6):
                await _call_once(upstreams, path)
                assert upstreams.current == names[(hop + 1) % 3]
                assert upstreams.held == sorted({names[hop % 3], upstreams.current})
            left = [a for a in names if a != upstreams.current]
            await eventually(lambda: _connections_to(left) == 0, "the channels left closed")
            assert upstreams.held == [upstreams.current]
        finally:
            await upstreams.close()


async def _call_once(upstreams: Upstreams, path: str) -> None:
    """A call forwarded to the scheduler `upstreams` follows, refused there, and its end taken
    in as the relay takes it in. (The refusal is let go of here: it holds its call, and the
    call its channel's connection.)"""
    address, method = upstreams.method("unary_unary", path)
    try:
        await method(b"", timeout=5)
    except grpc.aio.AioRpcError as error:
        await upstreams.settled(address, error.code(), error.trailing_metadata())
    else:
        raise AssertionError("a standby answered a call")
