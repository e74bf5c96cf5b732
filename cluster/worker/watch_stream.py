"""A worker's Watch call, the one that carries its membership: each registration attempt made
on it, and the accepted stream read until it ends.

`WorkerAgent` owns one `WatchStream` and hands it the core's `Register` actions. An attempt asks
the scheduler's challenge first under a job secret (kept for half its life), sends the
registration on a new Watch call and waits for the first answer within the bounds of
`AnswerLimit`; accepted, the call is kept for the agent's reader. `watch_forever` reads each
accepted stream: the scheduler's events, whole tables fetched by their digest (`peer_table`),
heartbeats on their own call (`Heartbeats`) and the scheduler's silence (`Silence`, which the
core measures without this process's own stalls, `StallWatch`); while the node runs direct
because its host's relay was lost, it looks for the relay and moves its stream back through it
once it is there again. Whatever happens goes to the core as its event (`convert`), through the
agent's interpreter, which carries out what the core decides.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

import grpc

from cluster.protocol import auth
from cluster.protocol.config import silence_limit
from cluster.protocol.errors import ClusterError
from cluster.protocol.topology import PeerColumns
from cluster.protocol.value import mutable
from cluster.transport import failures
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import calls, convert, peer_table
from cluster.worker.machine import steps
from cluster.worker.timers import AnswerLimit, Call, Heartbeats, Periodic, Silence, StallWatch

if TYPE_CHECKING:
    from cluster.worker.agent import WorkerAgent

TTL_USE_S = auth.CHALLENGE_TTL_S / 2  # a scheduler's challenge is used for half its life
# A node whose relay was lost looks for it this often; back, it registers through it (bounded by
# RELAY_MOVE_S); its direct channel closes as its calls end (`link.RELAY_MOVE_GRACE_S`).
RELAY_LOOK_S, RELAY_MOVE_S = 1.0, 10.0


@mutable
class _StreamTimers:
    """The timers that run while one accepted stream is read (`WatchStream._timers`)."""

    beats: Heartbeats | None = None
    stalls: StallWatch | None = None
    silence: Silence | None = None
    relay: Periodic | None = None

    def check_stalls(self) -> None:
        if self.stalls is not None:
            self.stalls.check()

    def stop(self) -> None:
        for timer in (self.relay, self.silence, self.stalls, self.beats):
            if timer is not None:
                timer.stop()


class WatchStream:
    """The Watch call of `agent`, a part it owns (see the module docstring). Its link, core,
    configuration and identity are the agent's, for the agent's life; the agent carries out
    what the core decides (`_run`) and holds the tasks set aside."""

    def __init__(self, agent: WorkerAgent) -> None:
        self._agent = agent
        self._link, self._core = agent._link, agent.core
        self._config, self._identity = agent.config, agent.identity
        self._challenge: tuple[str, bytes, str, float] | None = None  # a job secret's, renewed
        self.accepted: Call | None = None  # the accepted Watch stream, until it is read
        self.done = False  # the stream said its last word (a Done action)
        self._table = peer_table.HeldTable()  # the last whole table heard: the next delta's base
        self.up = False  # an accepted event stream is being read
        self._move: asyncio.Task[None] | None = None  # to the relay come back: `_back_to_relay`
        self._looking: asyncio.Task[None] | None = None  # for it: `_look_for_relay`

    # -- registering ---------------------------------------------------------------------------

    async def _ask_challenge(self, action: steps.Register) -> tuple[bytes, str] | steps.Event:
        """The scheduler's challenge for a registration under the job secret (kept for half
        its life), or what came of asking for it."""
        now, held = self._agent._clock(), self._challenge
        if held is not None and held[0] == self._core.address and now - held[3] < TTL_USE_S:
            return held[1], held[2]
        try:
            answer = await self._link.stub.Challenge(
                pb.ChallengeRequest(), timeout=action.attempt_s, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as exc:
            return convert.rpc_failure(exc, self._core.where)
        self._challenge = (self._core.address, answer.challenge, answer.job_id, now)
        return answer.challenge, answer.job_id

    async def register(self, action: steps.Register) -> steps.Event:
        """One registration attempt: what came of it, as the core's event. (A refusal for a
        stale challenge, after a restart of the scheduler, is met with a new one at once.)"""
        for _ in range(2):
            challenge: tuple[bytes, str] = (b"", "")
            if self._agent._job_secret is not None:
                asked = await self._ask_challenge(action)
                if not isinstance(asked, tuple):
                    return asked
                challenge = asked
            event = await self._register_once(action, challenge)
            if not (isinstance(event, steps.Refused) and event.stale_challenge):
                break
            self._challenge = None
        return event

    def registered(self, decided: list[steps.Action]) -> list[steps.Action]:
        """What the core decided on a registration's outcome; an accepted stream it will not
        have read (the node was closed meanwhile) is cancelled."""
        if self.accepted is not None and not any(isinstance(a, steps.Watch) for a in decided):
            self.accepted.cancel()
            self.accepted = None
        return decided

    async def _register_once(
        self, action: steps.Register, challenge: tuple[bytes, str]
    ) -> steps.Event:
        seq = 0 if self._agent._signer is None else self._agent._signer.floor
        request = pb.WatchRequest(
            register=convert.register_request(
                self._config,
                self._identity,
                self._core.cluster_id,
                self._agent._job_secret,
                challenge=challenge,
                call_seq=seq,
                collectives=self._core.answered,
            ),
            table_by_digest=self._link.route.relay is not None,  # the relay asks once for its host
        )
        call: Call = self._link.stub.Watch(request, wait_for_ready=True)
        try:
            answer = convert.answer(await self._answer(call, action))
        except (asyncio.TimeoutError, asyncio.InvalidStateError):
            call.cancel()
            return steps.Unanswered()
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            return convert.rpc_failure(exc, self._core.where)
        except ClusterError as exc:
            call.cancel()
            return steps.Fatal(exc)
        if isinstance(answer, steps.Accepted):
            self.accepted = call
            if self._agent.accepted_at is None:
                self._agent.accepted_at = self._agent._clock()
            return answer
        call.cancel()
        if isinstance(answer, steps.NotLeader):
            # The leader's certificate is checked before registering only with a CRL.
            verified = self._agent._tls is None or self._agent._tls.revocation is None
            return dataclasses.replace(answer, verified=verified)
        return answer

    async def _answer(self, call: Call, action: steps.Register) -> pb.Event:
        """The scheduler's answer to the registration on `call`, bounded by `AnswerLimit`; a move
        to the relay that the scheduler took (`_back_to_relay`) up to MS_NODE_TIMEOUT."""
        limit = AnswerLimit(
            call,
            self._link.channel,
            action.attempt_s,
            action.answer_s,
            self._answer_late,
            patient=lambda: self._agent._probe.found_up(self._link.host, self._link.port),
            longer=lambda: self._config.node_timeout_s * bool(self._move and not self.up),
        )
        try:
            return await convert.first_answer(call, self._core.where)
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            if limit.expired:
                raise asyncio.TimeoutError from None
            raise
        finally:
            limit.stop()

    def _answer_late(self, waited_s: float) -> None:
        """The registration has waited `waited_s` for its answer (from a timer: done aside)."""
        self._agent._set_aside(self._agent._run(self._core.step(steps.AnswerLate(waited_s))))

    # -- the stream ----------------------------------------------------------------------------

    async def watch_forever(self, watch: steps.Watch | None) -> None:
        """Read each accepted stream, and do what its loss calls for, until the core is done."""
        while watch is not None and self.accepted is not None:
            call, self.accepted = self.accepted, None
            lost, move = await self._watch_once(call, watch), self._move
            if lost is not None and move is not None:
                await asyncio.wait((move,))  # the direct stream, superseded, ended first
            if lost is not None and self.accepted is not None:
                continue  # superseded by the stream through the relay come back: read that
            if lost is not None:
                self._agent._closing(await self._link.off_lost_relay(self._core.address, lost))
                lost = self._link.relayed(lost)  # silent, the relay answering: it stays
            then = None if lost is None else await self._agent._run(self._core.step(lost))
            watch = then if isinstance(then, steps.Watch) else None

    async def _watch_once(self, call: Call, watch: steps.Watch) -> steps.Event | None:
        """Read `call` until it says its last word (None) or is lost (what ended it)."""
        timers = self._timers(call, watch)
        silence = timers.silence
        self.done, self.up = False, True
        try:
            while not self.done and not self._core.over:
                try:
                    message = await call.read()
                except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
                    timers.check_stalls()  # a stall that ended just now is the core's first
                    if silence is not None and silence.fired:
                        return steps.StreamLost("", silence.limit_s, self._agent._verified())
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    return self._lost(convert.lost(exc))
                timers.check_stalls()
                if silence is not None:
                    silence.heard()
                if message is grpc.aio.EOF:  # type: ignore[attr-defined]  # missing from stubs
                    return self._lost(steps.StreamLost("the scheduler closed the event stream"))
                assert isinstance(message, pb.Event)
                try:
                    event = self._event(message, await self._fetched(message))
                except peer_table.MissedChange as exc:
                    return self._lost(steps.StreamLost(f"{exc}; reconnecting for the whole table"))
                if event is not None:  # None: the scheduler's heartbeat, heard above
                    await self._agent._run(self._core.step(event))
            return None
        finally:
            self.up = False
            timers.stop()
            call.cancel()

    def _timers(self, call: Call, watch: steps.Watch) -> _StreamTimers:
        """The timers of reading `call`: its heartbeats, the scheduler's silence on it and this
        process's own stalls (with heartbeats on), and the look for a lost relay (while away)."""
        relay = Periodic(self._look_for_relay, RELAY_LOOK_S) if self._link.route.away else None
        if not self._config.heartbeat_enabled:
            return _StreamTimers(relay=relay)
        beats = Heartbeats(
            lambda: self._link.stub.Heartbeat(metadata=self._agent._signed("Heartbeat")),
            pb.HeartbeatRequest(
                node_id=self._identity.node_id, incarnation=self._identity.incarnation
            ),
            watch.heartbeat_interval_s,
            self._beats_refused,
        )
        stalls = StallWatch(self._stalled)
        limit_s = silence_limit(self._config.node_timeout_s, watch.heartbeat_interval_s)

        def left(heard_at: float) -> float:
            stalls.check()  # the core counts a stall that ended just now
            return self._core.silence_left(heard_at, limit_s)

        return _StreamTimers(beats, stalls, Silence(call, limit_s, left), relay)

    def _stalled(self, seconds: float) -> None:
        """This process did not run for `seconds` (from a timer: what follows is done aside)."""
        self._agent._set_aside(self._agent._run(self._core.step(steps.Stalled(seconds))))

    def _beats_refused(self, exc: grpc.aio.AioRpcError) -> bool:
        """A Heartbeat call the scheduler ended: whether it refused this node's certificate
        (revoked, expired), which fails the node with the scheduler's words; any other end is
        the event stream's to tell."""
        if not calls.refused_at_the_edge(exc):
            return False
        error = failures.failure_of(exc).error("heartbeat")
        self._agent._set_aside(self._agent._run(self._core.step(steps.Fatal(error))))
        return True

    def _look_for_relay(self) -> None:
        """While the stream runs direct: is the relay this node lost back (restarted, or
        running again)? Checked aside; the stream moves if it still runs direct then."""
        if self._looking is None and self._link.route.due is not None:
            self._looking = self._agent._set_aside(self._relay_looked_for())

    async def _relay_looked_for(self) -> None:
        why = await self._link.check_lost_relay()
        self._looking = None
        running = self.up and self._core.topology is not None and not self._core.over
        if why is not None and running and self._move is None and self._link.route.relay_back(why):
            self._move = self._agent._set_aside(self._back_to_relay())

    async def _back_to_relay(self) -> None:
        """Register again, this incarnation, through the relay: the scheduler ends the direct
        stream as superseded, no failure (read to its end, then the new one: no event missed).
        Failed, the node stays direct and looks again. Once the direct stream has ended, the
        scheduler took the move: the relay stream speaks for the node (given up, the node fails)."""
        move = self._link.to_relay(self._core.address)
        event = await self.register(steps.Register(RELAY_MOVE_S, RELAY_MOVE_S))
        self._move = None
        took = isinstance(event, steps.Accepted) and self.accepted is not None
        self._agent._closing(self._link.settle(move, took))

    def _lost(self, event: steps.StreamLost | steps.NotLeader) -> steps.Event:
        return dataclasses.replace(event, verified=self._agent._verified())

    async def _fetched(self, message: pb.Event) -> PeerColumns | None:
        """The whole table that a topology names by its digest, fetched (`peer_table.TABLES`)."""
        if message.WhichOneof("kind") != "topology_ready":
            return None
        digest = message.topology_ready.peers_digest
        if not digest:
            return None
        shared = self._link.route.relay is not None  # the relay shares the host's copy
        return await self._agent.tables.get(
            digest,
            lambda digest: peer_table.fetch(
                self._link.stub, self._agent._signed, digest, shared=shared
            ),
        )

    def _event(self, message: pb.Event, fetched: PeerColumns | None = None) -> steps.Event | None:
        """`message` as the core's event; a topology's table made whole (inflated, a delta laid
        over the last table heard, or `fetched` by its digest: `peer_table`), MissedChange when
        it cannot be."""
        table = None
        if message.WhichOneof("kind") == "topology_ready":
            table = self._table.take(message.topology_ready, fetched)
        held = self._core.topology
        try:
            return convert.stream_event(
                message,
                self._config,
                self._identity.node_id,
                table,
                host=self._identity.host,
                last_rank=None if held is None else held.rank,
            )
        except ClusterError as exc:
            return steps.Fatal(exc)
