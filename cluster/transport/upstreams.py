"""The relay's channels to a job's schedulers (`Upstreams`): which one its workers' calls go to
now (the leader, found from what the calls it forwarded came back with, and never one of
another job), and a wait for the port of one that went, so that a host's workers are back
within moments of their scheduler (`cluster.transport.relay` forwards the calls)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from cluster.protocol import backoff, leader_search, version
from cluster.protocol.parse import split_address
from cluster.transport import channel as scheduler_channel
from cluster.transport import failures, stub


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
# A scheduler the relay left: its channel is kept this long (the calls on it end meanwhile, and
# a relay that comes back to it at once, as it does while a leader's lease runs out, finds it
# open), then closed.
LEAVING_S = 5.0
# How long the relay waits for a leader a standby named to say which job it runs (its
# Challenge), and how long what it said stands (a scheduler at that address may be started
# again meanwhile); leaders kept so, and lines said of them, at most.
CHECK_S = 2.0
VERDICT_S = 10.0
VERDICTS_KEPT = 16
Trailing = tuple[tuple[str, Any], ...]


class Upstreams:
    """The relay's channels to the job's schedulers, and the one its workers' calls go to now:
    the leader, as `cluster.protocol.leader_search.Upstream` finds it from what the calls it
    forwarded came back with. `open_channel(address)` opens a channel: the current scheduler's,
    and the one of the scheduler it left last, kept LEAVING_S while the calls on it end (and
    taken again if the relay goes back to it meanwhile); one left before that closes at once.

    A leader a standby names is followed only if it runs the job the relay's workers are in:
    `job`, the cluster id of the last registration accepted through the relay (`heard`). Before
    the relay follows one (`settled`, `event`), it asks the leader which job it runs (a
    Challenge, CHECK_S at most): one of another job is not followed, said once in a line that
    names both jobs, and the answer reaches the workers naming no leader, so that they go on by
    the same rule as the relay (the next scheduler in turn), never to that job's scheduler. One
    that does not say in time is taken for down (not followed for `leader_search.DOWN_FOR_S`,
    as one a call found down). Before a registration was accepted through it, the relay knows
    no job, and follows whom it is told.

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
        self._leaving: tuple[str, asyncio.Task[None]] | None = None  # the one left last
        self._closing: set[asyncio.Future[None]] = set()
        self._moves = 0  # how often it moved
        self.job = ""  # the job its workers are in: "" until a registration is accepted
        self._verdicts: dict[str, tuple[bool, float]] = {}  # leader -> (followed, when)
        self._checking: dict[str, asyncio.Future[bool]] = {}  # leader -> its check
        self._said: set[tuple[str, str]] = set()  # (leader, its job) said not followed

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
        left = self._upstream.current
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
            self._leave(left)
            self._moves += 1
            self.channel(moved).get_state(try_to_connect=True)

    def _leave(self, address: str) -> None:
        """Keep the channel to `address`, the scheduler the relay left, for LEAVING_S, then
        close it (not if the relay is back there by then); the one left before closes now."""
        if self._leaving is not None:
            gone, timer = self._leaving
            timer.cancel()
            self._leaving = None
            if gone not in (address, self.current):
                self._close(gone)
        if address in self._channels:
            self._leaving = (address, asyncio.ensure_future(self._close_later(address)))

    async def _close_later(self, address: str) -> None:
        await asyncio.sleep(LEAVING_S)
        self._leaving = None  # (a timer cancelled never gets here)
        if address != self.current:
            self._close(address)

    def _close(self, address: str) -> None:
        """Close the channel to `address`, now (its calls are cancelled)."""
        channel = self._channels.pop(address, None)
        self._methods.pop(address, None)
        if channel is not None:
            closing = asyncio.ensure_future(scheduler_channel.close_for_good(channel, None))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    @property
    def held(self) -> list[str]:
        """The schedulers the relay holds a channel to: the current one, and the one it left
        last, for LEAVING_S."""
        return sorted(self._channels)

    def heard(self, event: bytes) -> None:
        """An event that came down to the relay's workers: a registration accepted names the
        job they are in."""
        job = stub.accepted_job_of(event)
        if job and job != self.job:
            self.job = job
            self._verdicts.clear()

    async def settled(self, address: str, code: grpc.StatusCode, trailing: Any) -> Trailing:
        """`answered`, once a leader the trailing metadata names is checked (`may_follow`):
        the trailing metadata as the worker gets it, naming no leader the relay does not
        follow."""
        pairs = tuple((str(key), value) for key, value in trailing or ())
        leader = str(_named(pairs).get(failures.LEADER_KEY, ""))
        moves = self._moves
        if leader and not await self.may_follow(address, leader):
            pairs = tuple((k, "" if k == failures.LEADER_KEY else v) for k, v in pairs)
        if self._moves == moves:  # else the relay moved while it checked: a late word
            self.answered(address, code, pairs)
        return pairs

    async def event(self, address: str, event: bytes) -> bytes:
        """A Watch's event from `address` as its worker gets it: a standby's refusal of its
        registration names no leader the relay does not follow (`may_follow`)."""
        leader = stub.named_leader_of(event)
        if leader is None or await self.may_follow(address, leader):
            return event
        return stub.without_leader(event)

    async def may_follow(self, asked: str, leader: str) -> bool:
        """Whether the relay may follow `leader`, named by the standby at `asked`: it runs the
        relay's job, or the relay knows none yet, or it runs none (a standby: it names its own
        leader, checked in turn). Checked once for every call that names it meanwhile, and only
        where the relay would follow it now."""
        now = self._clock()
        verdict = self._verdicts.get(leader)
        if verdict is not None and now - verdict[1] < VERDICT_S:
            return verdict[0]
        if not self.job or not self._upstream.follows(asked, leader, now):
            return True  # known or not, it is not followed from here now
        checking = self._checking.get(leader)
        if checking is None:
            checking = self._checking[leader] = asyncio.ensure_future(self._check(asked, leader))
            checking.add_done_callback(lambda _: self._checking.pop(leader, None))
        return await asyncio.shield(checking)

    async def _check(self, asked: str, leader: str) -> bool:
        job = await self._job_of(leader)
        if job is None:  # taken for down, as a call cut off there would find it
            self._upstream.found_down(leader, self._clock())
            return True
        followed = job in ("", self.job)
        self._verdicts[leader] = (followed, self._clock())
        while len(self._verdicts) > VERDICTS_KEPT:
            del self._verdicts[next(iter(self._verdicts))]
        if not followed:
            self._say_once(
                leader,
                job,
                f"not following the leader at {leader} that the scheduler at {asked} names: it "
                f"runs job {job}, and this relay's workers are in job {self.job} (is that "
                "standby started on another job's state, or left from another job?); the "
                "workers and the relay go on to this job's other schedulers",
            )
        return followed

    def _say_once(self, leader: str, job: str, line: str) -> None:
        if (leader, job) not in self._said and len(self._said) < VERDICTS_KEPT:
            self._said.add((leader, job))
            self._say(line)

    async def _job_of(self, leader: str) -> str | None:
        """The job the scheduler at `leader` runs, as its Challenge says ("": none, a
        standby's); None when it did not say within CHECK_S."""
        channel = self._open(leader)
        try:
            path = stub.methods()["Challenge"][1]
            challenge = channel.unary_unary(path, None, None)  # bytes as they come
            stamp = ((version.METADATA_KEY, version.stamp()),)
            raw = await challenge(b"", metadata=stamp, timeout=CHECK_S)
            return stub.challenge_job_of(bytes(raw))
        except (grpc.aio.AioRpcError, DecodeError):
            return None
        finally:
            await scheduler_channel.close_for_good(channel, None)

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
        for checking in list(self._checking.values()):
            checking.cancel()
        if self._leaving is not None:
            self._leaving[1].cancel()
        for closing in list(self._closing):
            await closing
        for channel in self._channels.values():
            await channel.close(grace=None)


def _backing_off(channel: grpc.aio.Channel) -> bool:
    """Whether `channel` waits out gRPC's pause after a failed connection attempt."""
    state = channel.get_state(try_to_connect=False)
    return bool(state == grpc.ChannelConnectivity.TRANSIENT_FAILURE)
