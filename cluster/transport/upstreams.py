"""The relay's channels to a job's schedulers (`Upstreams`): which one its workers' calls go to
now (the leader, found from what the calls it forwarded came back with), and a wait for the port
of one that went, so that a host's workers are back within moments of their scheduler
(`cluster.transport.relay` forwards the calls)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any

import grpc

from cluster.protocol import backoff, leader_search
from cluster.protocol.parse import split_address
from cluster.transport import channel as scheduler_channel
from cluster.transport import failures


def cut_off(code: grpc.StatusCode, keys: Container[str]) -> bool:
    """Whether a forwarded call that ended with `code` and trailing metadata of `keys` was cut
    off: UNAVAILABLE with no kind (the scheduler, or the way to it, went)."""
    return code == grpc.StatusCode.UNAVAILABLE and failures.ERROR_KIND_KEY not in keys


def _named(trailing: Iterable[Any] | None) -> dict[str, Any]:
    """A call's trailing metadata by key."""
    return {str(key): value for key, value in trailing or ()}


# A wait for a scheduler's port looks again this often whether the channel still backs off.
RETURN_CHECK_S = 5.0
# A channel whose pauses between connection attempts are at most this long (a job of up to 1,000
# nodes) is left to them: waiting for the port would gain less than a pause, and replacing the
# channel cuts the calls still waiting on it (made again by their workers).
PORT_WAIT_PAUSE_S = 1.0


class Upstreams:
    """The relay's channels to the job's schedulers, and the one its workers' calls go to now:
    the leader, as `cluster.protocol.leader_search.Upstream` finds it from what the calls it
    forwarded came back with. `open_channel(address)` opens a channel; one per scheduler at
    most, kept until `close` (a call on a scheduler left behind ends as it would have).

    A channel cut off from its scheduler pauses between gRPC's connection attempts, longer each
    time, up to `pause_s` (`reconnect_ceiling_ms` of the job: a minute at 65,536 nodes). Past
    PORT_WAIT_PAUSE_S the relay waits for the scheduler's port meanwhile, and opens a new channel
    once the port takes connections, so that its workers are back within moments of the
    scheduler, not after the channel's pause. It tries the port as often as the workers it serves
    (`serving()`: how many) would if they connected directly, in a job of `nodes`
    (`backoff.listen_pace`): the job's relays together as often as its nodes."""

    def __init__(
        self,
        addresses: Sequence[str],
        open_channel: Callable[[str], grpc.aio.Channel],
        say: Callable[[str], None] = lambda line: None,
        clock: Callable[[], float] = time.monotonic,
        *,
        nodes: int = 1,
        pause_s: float = 0.0,
        serving: Callable[[], int] = lambda: 1,
    ) -> None:
        self._upstream = leader_search.Upstream(addresses)
        self._open, self._say, self._clock = open_channel, say, clock
        self._nodes, self._serving = nodes, serving
        self._wait_for_port = pause_s > PORT_WAIT_PAUSE_S
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._methods: dict[str, dict[str, Any]] = {}
        self._returning: dict[str, asyncio.Task[None]] = {}  # address -> its port's wait

    @property
    def current(self) -> str:
        return self._upstream.current

    def channel(self, address: str | None = None) -> grpc.aio.Channel:
        """The channel to `address` (default: the current scheduler), opened on first use."""
        address = address or self._upstream.current
        if address not in self._channels:
            self._channels[address] = self._open(address)
            self._methods[address] = {}
        return self._channels[address]

    def method(self, kind: str, path: str) -> tuple[str, Any]:
        """The current scheduler's address, and its multi-callable for `path` (bytes as they
        came: no serializers)."""
        address = self._upstream.current
        methods = self._methods.get(address)
        if methods is None:
            self.channel(address)
            methods = self._methods[address]
        if path not in methods:
            methods[path] = getattr(self._channels[address], kind)(path)
        return address, methods[path]

    def answered(self, address: str, code: grpc.StatusCode, trailing: Any) -> None:
        """What a call forwarded to `address` came back with: a standby naming the leader
        (`cluster-leader`, on a refusal or a refused registration's stream) or a call cut off
        (UNAVAILABLE with no kind: the scheduler or the way to it went) moves the relay."""
        named = _named(trailing)
        now = self._clock()
        if failures.LEADER_KEY in named:
            leader = str(named[failures.LEADER_KEY])
            moved = self._upstream.not_leader(address, leader, now)
            why = f"the scheduler at {address} stands by"
        elif cut_off(code, named):
            moved = self._upstream.cut_off(address, now)
            why = f"the scheduler at {address} did not answer"
            self._await_return(address)
        else:
            return
        if moved is not None:
            self._say(f"following the leader at {moved} ({why})")
            self.channel(moved).get_state(try_to_connect=True)

    def _await_return(self, address: str) -> None:
        """Wait for the port of the scheduler at `address`, cut off, if its channel backs off."""
        channel = self._channels.get(address)
        if not self._wait_for_port or channel is None or address in self._returning:
            return
        if _backing_off(channel):
            wait = asyncio.ensure_future(self._reopen_when_taken(address, channel))
            self._returning[address] = wait
            wait.add_done_callback(lambda _: self._returning.pop(address, None))

    async def _reopen_when_taken(self, address: str, channel: grpc.aio.Channel) -> None:
        """Try the port at the listening pace (`backoff.listen_pace`) while `channel` backs
        off; once the port takes a connection, the next call opens a new channel."""
        host, port = split_address("the scheduler address", address)
        began = self._clock()
        while self._paused(address, channel):
            every_s, for_s = self.port_pace(self._clock() - began)
            if not await scheduler_channel.await_taken(host, port, for_s, every_s):
                continue
            if self._paused(address, channel):
                del self._channels[address]
                self._methods.pop(address, None)
                self._say(f"the scheduler at {address} takes connections again")
                await scheduler_channel.close_for_good(channel, None)
            return

    def port_pace(self, waited_s: float) -> tuple[float, float]:
        """(every_s, for_s) of a wait for a scheduler's port `waited_s` in: the pace of the
        workers it serves now (`backoff.listen_pace`)."""
        return backoff.listen_pace(waited_s, self._nodes, RETURN_CHECK_S, self._serving())

    def _paused(self, address: str, channel: grpc.aio.Channel) -> bool:
        """Whether `channel` is still the one to `address`, and waits out gRPC's pause."""
        return self._channels.get(address) is channel and _backing_off(channel)

    async def close(self) -> None:
        for wait in list(self._returning.values()):
            wait.cancel()
        for channel in self._channels.values():
            await channel.close(grace=None)


def _backing_off(channel: grpc.aio.Channel) -> bool:
    """Whether `channel` waits out gRPC's pause after a failed connection attempt."""
    state = channel.get_state(try_to_connect=False)
    return bool(state == grpc.ChannelConnectivity.TRANSIENT_FAILURE)
