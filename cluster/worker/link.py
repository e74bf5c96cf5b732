"""A worker's link to the scheduler: the route its calls take (through its host's relay while
the relay answers, else direct: `scheduler_link.Route`), the channel and stub on that route, and
the moves between routes: to a leader it follows, off a relay found lost, and back to a relay
found again (make before break). A channel a move leaves is handed back to the caller as its
closing, to run beside its other work (`close_for_good`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc

from cluster.protocol.config import ClusterConfig
from cluster.protocol.parse import split_address
from cluster.protocol.value import frozen
from cluster.transport.channel import close_for_good
from cluster.transport.stub import LazyStub
from cluster.worker import scheduler_link
from cluster.worker.machine import steps

if TYPE_CHECKING:
    from cluster.transport import tls
    from cluster.transport.hop_channel import HopChannel

# A move back to the relay that the scheduler took closes the direct channel once its calls
# end, at most this much later.
RELAY_MOVE_GRACE_S = 30.0
Closing = Coroutine[Any, Any, None]
RELAY_CHECK_S = scheduler_link.RELAY_CHECK_S


async def _check(relay: str, *, kept_up: bool = False) -> str:
    """`scheduler_link.relay_check` of `relay` (why it does not answer, "" when it does), in a
    thread: off the event loop, which a relay of this process may run on, and which a stopped
    relay would hold up for RELAY_CHECK_S."""
    return await asyncio.to_thread(scheduler_link.relay_check, relay, kept_up=kept_up)


@frozen
class Move:
    """A move back to the relay under way: the direct channel and stub it leaves (kept until the
    scheduler takes the move), and the channel through the relay."""

    direct: grpc.aio.Channel
    stub: LazyStub
    moved: grpc.aio.Channel


class Link:
    """The way of one worker's calls to the scheduler at `address` (see the module docstring);
    `host` and `port` are the scheduler's that the worker talks to now."""

    def __init__(
        self,
        config: ClusterConfig,
        identity: tls.Identity | None,
        say: Callable[[str], None],
        address: str,
    ) -> None:
        self._identity = identity
        self.host, self.port = config.sched_host, config.sched_port
        self.route = scheduler_link.Route(config, say)  # through the host's relay, or direct
        self.channel: grpc.aio.Channel = self.route.open(address, identity)
        self.stub = LazyStub(self.channel)

    def follow(self, address: str) -> Closing:
        """Talk to the scheduler at `address` from now on: the old channel's closing."""
        self.host, self.port = split_address("the scheduler address", address)
        old = self.channel
        self.channel = self.route.open(address, self._identity)
        self.stub = LazyStub(self.channel)
        return close_for_good(old, None)

    @property
    def hop(self) -> HopChannel | None:
        """The channel, when it is the local hop to the relay (None: direct)."""
        if self.route.relay is None:
            return None
        from cluster.transport.hop_channel import HopChannel  # noqa: PLC0415 - behind a relay

        return self.channel if isinstance(self.channel, HopChannel) else None

    async def check_relay(self, address: str) -> Closing | None:
        """At start: to the scheduler at `address` directly when no relay answers at the host's
        (`Route.checked`). The old channel's closing when the node moved."""
        relay = self.route.relay
        if relay is None or not self.route.checked(await _check(relay, kept_up=True)):
            return None
        return self.follow(address)

    async def off_lost_relay(self, address: str, lost: steps.Event | None = None) -> Closing | None:
        """To the scheduler at `address` directly once the relay of this node's calls is gone;
        back through the relay, once it answers again, when the stream is lost. With the stream
        `lost`, the relay is cut off when the hop to it went down or silent too
        (`HopChannel.answering`: a stopped relay still takes connections, and answers no ping);
        a stream silent while the relay answers is silent beyond it (the scheduler stalled), and
        the node stays, as the relay's other workers do, rather than all of them turning to a
        scheduler that comes back at once. Otherwise the relay is checked. The old channel's
        closing when the node moved."""
        due = self.route.due
        if lost is not None and due is not None and self.route.relay_back(await _check(due)):
            return self.follow(address)
        relay, hop = self.route.relay, self.hop
        if relay is None:
            return None
        cut_off = lost is not None and hop is not None and not hop.answering(RELAY_CHECK_S)
        why = "" if cut_off else await _check(relay)
        return self.follow(address) if self.route.relay_lost(cut_off=cut_off, why=why) else None

    def leave_relay(self, address: str, why: str, *, refused: bool = False) -> Closing | None:
        """To the scheduler at `address` directly: the relay answered none of this node's calls
        (`why`), or, `refused`, its scheduler refused this node as another job's
        (`Route.relay_refused`). The old channel's closing when the node moved."""
        if refused:
            left = self.route.relay_refused(why)
        else:
            left = self.route.relay_lost(cut_off=True, why=why)
        return self.follow(address) if left else None

    async def check_lost_relay(self) -> str | None:
        """Why the relay this node lost does not answer ("" when it does: `Route.relay_back`
        takes it back); None before it is time to look."""
        relay = self.route.due
        return None if relay is None else await _check(relay)

    def relayed(self, event: steps.Event) -> steps.Event:
        """`event` marked with the relay it came through where the core tells by it whose
        silence it was: a stream silent while the relay answers (`StreamLost.relay`: the silence
        is beyond it); a registration unanswered, not cut off by the relay, with the hop to it
        down or silent too (`Unanswered.relay`: the relay is lost if the scheduler answers; a
        registration a busy scheduler is slow to answer leaves the relay answering); a
        refusal (`Refused.relay`: the scheduler the relay forwards to refused it)."""
        hop = self.hop
        if hop is None:
            return event
        if isinstance(event, steps.Refused):  # the relay's scheduler's refusal
            return dataclasses.replace(event, relay=hop.address)
        answering = hop.answering(RELAY_CHECK_S)
        if isinstance(event, steps.StreamLost) and event.silent_s is not None and answering:
            return dataclasses.replace(event, relay=hop.address)
        if isinstance(event, steps.Unanswered) and not (event.relay_cut_off or answering):
            return dataclasses.replace(event, relay=hop.address)
        return event

    def to_relay(self, address: str) -> Move:
        """Calls go through the relay found back from now on; the direct channel is kept until
        the move is `settled`."""
        move = Move(self.channel, self.stub, self.route.open(address, self._identity))
        self.channel, self.stub = move.moved, LazyStub(move.moved)
        return move

    def settle(self, move: Move, took: bool) -> Closing | None:
        """The scheduler `took` the node's stream through the relay: the direct channel's
        closing, once its calls end. Not taken: direct again, unless something else moved the
        node meanwhile, and looked for again later; the relay channel's closing."""
        if took:
            self.route.move_took()
            return close_for_good(move.direct, RELAY_MOVE_GRACE_S)
        if self.channel is not move.moved:
            return None
        self.route.move_failed()
        self.channel, self.stub = move.direct, move.stub
        return close_for_good(move.moved, None)
