"""A host relay's batched beats (`cluster.transport.relay.HostBeats`) reach a real scheduler
whatever the host's workers and the length of their ids; the relay reads how each of its beats'
calls ended, as every call it forwards: a scheduler's refusal of them is said once in the
relay's log, and a standby's (on a real etcd) sends the relay to the leader it names."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.protocol import version
from cluster.scheduler import SchedulerServer
from cluster.scheduler.machine.member_bounds import BeatGate
from cluster.tools import relay as relay_tool
from cluster.tools.relay import Relay, RelaySettings
from cluster.transport.relay import HostBeats
from cluster.transport.upstreams import Upstreams
from cluster.v1 import scheduler_pb2 as pb
from tests.aio import eventually
from tests.integration.test_relay import make_agent, settings
from tests.integration.test_stepping_down import leader_and_standby
from tests.servers.etcd import EtcdCluster

# Workers of a host besides the real one, each with an id of 128 characters: their batch names
# about 290 KiB, past the 256 KiB the scheduler takes of one HostBeats message.
OTHERS = 2000


class _Beating:
    """The context of a local worker's Heartbeat call, as the relay's handler uses it."""

    code = None

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> None:
        return None

    def set_trailing_metadata(self, trailing: object) -> None:
        pass

    def set_code(self, code: object) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        pass


async def _beats(nodes: list[tuple[str, int]]) -> AsyncIterator[bytes]:
    for node_id, incarnation in nodes:
        yield pb.HeartbeatRequest(node_id=node_id, incarnation=incarnation).SerializeToString()


async def test_a_workers_beat_counts_among_thousands_of_long_ids_behind_its_relay(
    short_dir: Path,
) -> None:
    """A real worker behind a real relay, its host's other 2,000 workers beating with
    128-character ids at the same time: the relay's batch of them all is past the scheduler's
    limit for one message, and the scheduler still counts the worker's beat (it took every
    message of the batch: none refused at its edge)."""
    # The worker's own beats: none in the test's time.
    quiet = dataclasses.replace(settings(1), node_timeout_s=120.0, heartbeat_interval_s=60.0)
    async with SchedulerServer(quiet) as srv:
        address = f"unix:{short_dir / 'r.sock'}"
        relay = Relay(RelaySettings(address, f"127.0.0.1:{srv.port}", 1, 30.0))
        await relay.start()
        said: list[str] = []
        agent = make_agent(srv.port, 1, "a", said, CLUSTER_RELAY=address)
        try:
            await asyncio.wait_for(agent.start(), 20)
            member = srv.core.state.members["a"]
            # Two rounds of beats at once: taken however soon (a beat sooner than a quarter
            # of the interval is dropped otherwise, `MemberLimits.beat`).
            srv.core.bounds.beats = BeatGate(0.0)
            host = [("n" * 120 + f"{i:08d}", (1 << 62) + i) for i in range(OTHERS)]
            host.append(("a", agent.identity.incarnation))
            beats = relay._forwarder.beats  # type: ignore[attr-defined]
            for _ in range(2):
                before = member.last_seen
                context = _Beating()
                assert await beats.local(_beats(host), context) == b""
                assert context.code is None
                await eventually(lambda b=before: member.last_seen != b, "a's beat counted")
            assert srv.gate.refusals.counts == {}
            assert said == []
        finally:
            await agent.close()
            await relay.stop()


# A channel's and a server's flow-control window stays at HTTP/2's 64 KiB.
_NO_WINDOW_GROWTH = [("grpc.http2.bdp_probe", 0)]
# A local worker's heartbeat interval, in the tests that beat on: a tenth of their node timeout.
BEAT_S = 0.2


async def _beating(through: Relay, node: tuple[str, int]) -> None:
    """A local worker that beats through a relay every BEAT_S until cancelled."""
    beats = through._forwarder.beats  # type: ignore[attr-defined]
    while True:
        await beats.local(_beats([node]), _Beating())
        await asyncio.sleep(BEAT_S)  # sleep-ok: the worker's beat interval, not a wait for an event


@contextlib.asynccontextmanager
async def _relay_beating(settings: RelaySettings) -> AsyncIterator[Relay]:
    """A relay with one local worker beating through it."""
    running = Relay(settings)
    await running.start()
    beating = asyncio.ensure_future(_beating(running, ("a", 1)))
    try:
        yield running
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
        await running.stop()


class _Log:
    """What the relays of this process say (`mscluster relay: ...` lines), as they print it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._out = io.StringIO()
        say = relay_tool._say
        monkeypatch.setattr(relay_tool, "_say", lambda line: say(line, self._out))

    def read(self) -> str:
        return self._out.getvalue()


async def test_a_scheduler_that_refuses_the_relays_beats_is_said_once(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay of another protocol revision than its scheduler's: the scheduler refuses each of
    its HostBeats calls, and the relay's log says so once, in the words docs/howto/launcher.md
    shows, however many of its batches were refused."""
    monkeypatch.setattr(version, "stamp", lambda: "999 9.9.9")  # what the relay's calls name
    async with SchedulerServer(settings(1)) as srv:
        scheduler = f"127.0.0.1:{srv.port}"
        address = f"unix:{short_dir / 'r.sock'}"
        log = _Log(monkeypatch)
        async with _relay_beating(RelaySettings(address, scheduler, 1, 2.0)):
            # A batch's refusal is read as the next batch goes: four refused, three read.
            await eventually(
                lambda: srv.gate.refusals.counts[("HostBeats", "version")] >= 4,
                "four batches refused",
            )
        said = [line for line in log.read().splitlines() if "refused this host's beats" in line]
        assert len(said) == 1, said
        assert said[0].startswith(
            f"mscluster relay: the scheduler at {scheduler} refused this host's beats ("
        )
        assert "protocol revision 999" in said[0]
        assert said[0].endswith("(said once)")


async def test_a_relays_beats_refused_by_a_standby_follow_it_to_the_leader(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, etcd_cluster: EtcdCluster
) -> None:
    """A relay whose first scheduler is a standby, with no worker call through it but the
    beats: the standby refuses the beats' call naming the leader, and the relay follows it
    there, as it does for any call it forwards; its beats go to the leader from then on. A
    standby's refusal is no refusal to say."""
    async with leader_and_standby(etcd_cluster) as (leader, standby):
        at_leader, at_standby = leader.gate.address, standby.gate.address
        address = f"unix:{short_dir / 'r.sock'}"
        log = _Log(monkeypatch)
        relay_settings = RelaySettings(address, at_standby, 1, 2.0, others=(at_leader,))
        async with _relay_beating(relay_settings):
            followed = f"following the leader at {at_leader} (the scheduler at {at_standby}"
            await eventually(lambda: followed in log.read(), "the relay to follow the leader")
            await eventually(
                lambda: leader.servicer.host_calls.held == 1, "the beats' call at the leader"
            )
        assert "refused this host's beats" not in log.read()


class _Unread(grpc.GenericRpcHandler):  # type: ignore[type-arg]  # generic in the stubs only
    """A scheduler whose HostBeats reads nothing: once gRPC's flow-control window is full, a
    write on the call waits."""

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        async def hold(requests: AsyncIterator[bytes], context: object) -> bytes:
            await asyncio.Event().wait()  # until the server stops
            return b""

        return (
            grpc.stream_unary_rpc_method_handler(hold)
            if details.method.endswith("/HostBeats")
            else None
        )


class _Writes:
    """A real channel whose calls' writes the test sees begin and end (all else is the
    channel's and its calls' own)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel, self.begun, self.under_way = channel, 0, 0

    def stream_unary(self, path: str) -> Any:
        method: Any = self.channel.stream_unary(path)
        return lambda **kwargs: _Written(method(**kwargs), self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.channel, name)


class _Written:
    """A real call on a `_Writes` channel, which counts its writes."""

    def __init__(self, call: Any, writes: _Writes) -> None:
        self._call, self._writes = call, writes

    async def write(self, raw: bytes) -> None:
        self._writes.begun += 1
        self._writes.under_way += 1
        try:
            await self._call.write(raw)
        finally:
            self._writes.under_way -= 1

    def __await__(self) -> Any:
        return self._call.__await__()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


async def test_a_write_cancelled_with_its_channel_stops_no_beats() -> None:
    """The relay's beats' call to a scheduler it leaves has a write under way, waiting for the
    scheduler to read, when the relay closes that scheduler's channel (as it does to replace
    one): gRPC's write raises CancelledError. The batch is lost; the beats heard meanwhile go
    up to the scheduler the relay follows, on a call of their own, with no other beat needed."""
    held = grpc.aio.server(options=_NO_WINDOW_GROWTH)
    held.add_generic_rpc_handlers((_Unread(),))
    at_held = f"127.0.0.1:{held.add_insecure_port('127.0.0.1:0')}"
    await held.start()
    channels: dict[str, _Writes] = {}

    def open_channel(address: str) -> Any:
        channels[address] = _Writes(grpc.aio.insecure_channel(address, options=_NO_WINDOW_GROWTH))
        return channels[address]

    try:
        async with SchedulerServer(settings(1)) as srv:
            upstreams = Upstreams([at_held, f"127.0.0.1:{srv.port}"], open_channel)
            beats = HostBeats(upstreams, 0.01)
            try:
                # 540 KB in messages of 32 KiB: the second is past the 64 KiB window, and waits.
                host = [("n" * 120 + f"{i:08d}", i) for i in range(4000)]
                await beats.local(_beats(host), _Beating())

                def waits() -> bool:
                    writes = channels.get(at_held)
                    return writes is not None and writes.begun >= 2 and writes.under_way == 1

                await eventually(waits, "a write past the window, waiting")
                await beats.local(_beats([("v", 1)]), _Beating())  # heard meanwhile
                upstreams.answered(at_held, grpc.StatusCode.UNAVAILABLE, ())  # it moves
                await channels[at_held].channel.close(None)  # the write under way is cancelled
                await eventually(
                    lambda: srv.servicer.host_calls.held == 1, "v's batch at the next scheduler"
                )
            finally:
                beats.stop()
                await upstreams.close()
    finally:
        await held.stop(None)
