"""The worker's side of the protocol, asynchronous: the I/O around the pure worker core.

`WorkerAgent` runs on a background event loop (see `cluster.worker.session`). What it decides is
decided by `cluster.worker.machine.core.WorkerCore` (registration retries and deadlines, the
reconnect policy, following a leader, what an event or a lost stream means, when the job is over for
this node, whether a call or a Finish is made again); every reaction goes `core.step(event)` ->
actions -> `_run`, the one interpreter, which carries them out (register, probe, pause, read the
Watch stream with heartbeats, deliver the topology, send the Finish, report a failure through
`on_fatal` exactly once) and steps the core with what came of them, converted from protobuf by
`cluster.worker.convert` (etcd's raft/RawNode split). Every call it makes for the user goes through
`cluster.worker.calls`, and races against the job's failure (`cluster.worker.racing`), so no caller
waits on a job that is already over."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from cluster.protocol import auth
from cluster.protocol.backoff import Spread
from cluster.protocol.config import ClusterConfig, silence_limit
from cluster.protocol.environment import read_job_secret
from cluster.protocol.errors import ClusterError
from cluster.protocol.exhaustive import assert_never
from cluster.protocol.topology import PeerColumns, Topology
from cluster.transport import failures, membership
from cluster.transport.channel import SchedulerProbe
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import calls, convert, peer_table, scheduler_link
from cluster.worker.generation_end import GenerationEnd
from cluster.worker.identity import NodeIdentity
from cluster.worker.link import Closing, Link
from cluster.worker.machine import steps
from cluster.worker.machine.core import WorkerCore
from cluster.worker.racing import unless_failed
from cluster.worker.timers import AnswerLimit, Call, Heartbeats, Periodic, Silence

TTL_USE_S = auth.CHALLENGE_TTL_S / 2  # a scheduler's challenge is used for half its life
# A node whose relay was lost looks for it this often; back, it registers through it (bounded by
# RELAY_MOVE_S); its direct channel closes as its calls end (`link.RELAY_MOVE_GRACE_S`).
RELAY_LOOK_S, RELAY_MOVE_S = 1.0, 10.0
Outcome = steps.Watch | steps.RetryCall | None  # for the caller: a stream, a call again, or none


class WorkerAgent:
    # Whole tables fetched by digest: the process's, shared by its agents (one agent's own: set it).
    tables: peer_table.FetchedTables = peer_table.TABLES

    def __init__(
        self,
        config: ClusterConfig,
        identity: NodeIdentity,
        *,
        say: Callable[[str], None],
        on_fatal: Callable[[ClusterError], None],
        expiry_check_period_s: float | None = None,
        cluster_id: str = "",
        probe: SchedulerProbe | None = None,
    ) -> None:
        """`cluster_id`: the job this node belonged to before its process restarted (its saved
        recovery file), so that a scheduler running another job refuses it. `probe`: the checks
        of the scheduler it shares with its owner's other agents (default: its own).
        `expiry_check_period_s`: how often TLS certificates are checked for expiry (None: daily)."""
        self.config = config
        self.identity = identity
        # The agent's clock is the core's: deadlines the core sets are waited for here.
        self._clock = time.monotonic
        # Its pauses are jittered from its incarnation: no two processes of a job draw alike.
        draws = Spread(identity.incarnation)
        self.core = WorkerCore(config, self._clock, cluster_id=cluster_id, draws=draws)
        self._say = say
        self._on_fatal = on_fatal
        self._tls = None if config.tls is None else scheduler_link.prepare_tls(config.tls, say)
        self._probe = SchedulerProbe() if probe is None else probe
        self._expiry_check_period_s = expiry_check_period_s
        self._expiry: asyncio.Task[None] | None = None
        self._job_secret = None if config.job_secret is None else read_job_secret(config.job_secret)
        # Every call after the registration says which node makes it: with its credential, or
        # with a job secret a call proof that never shows it (`membership.CallSigner`).
        self._metadata = membership.call_metadata(
            identity.node_id, identity.incarnation, identity.credential
        )
        self._signer = membership.signer(self._job_secret, identity)
        self._challenge: tuple[str, bytes, str, float] | None = None  # a job secret's, renewed
        self._link = Link(config, self._tls, say, self.core.address)  # its route, channel, stub
        self._aside: set[asyncio.Task[Any]] = set()  # old channels closing, late answers said
        self._accepted: Call | None = None  # the accepted Watch stream, until it is read
        self._stream_done = False  # the stream said its last word (a Done action)
        self._table = peer_table.HeldTable()  # the last whole table heard: the next delta's base
        self._stream_up = False  # an accepted event stream is being read
        self._back = asyncio.Event()  # accepted again, or over: a held Finish goes on
        self._move: asyncio.Task[None] | None = None  # to the relay come back: `_back_to_relay`
        self._looking: asyncio.Task[None] | None = None  # for it: `_look_for_relay`
        self.accepted_at: float | None = None  # first accepted (this clock): a benchmark's stage
        loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[Topology] = loop.create_future()
        self._fatal: asyncio.Future[ClusterError] = loop.create_future()
        self._watch_task: asyncio.Task[None] | None = None
        # Set when a new generation arrives / a peer of this one failed (each replaced then).
        self._new_generation = asyncio.Event()
        self._peer_failed = asyncio.Event()
        self._calls = calls.Calls(
            self._link, self._signer, self._signed, self._fatal, self.core, self._run
        )
        self._report_seq = 0  # checkpoint reports are numbered
        self._add_seq = 0  # and key-value adds
        self.resumed_in: int | None = None  # the generation whose rollback this worker put back
        self.generation_end = GenerationEnd(say)  # told off this loop when a generation is over

    # -- what the core knows -------------------------------------------------------------------

    @property
    def cluster_id(self) -> str:
        return self.core.cluster_id

    @property
    def topology(self) -> Topology | None:
        return self.core.topology

    @property
    def fatal(self) -> ClusterError | None:
        return self._fatal.result() if self._fatal.done() else None

    # -- start ---------------------------------------------------------------------------------

    async def start(self) -> Topology:
        """Register and wait until the whole topology is ready. A failure to join is raised
        here, not reported through `on_fatal`: the caller is there to hear it."""
        if self._tls is not None:
            from cluster.transport import tls  # noqa: PLC0415 - TLS only

            period_s = self._expiry_check_period_s or tls.EXPIRY_CHECK_PERIOD_S
            self._expiry = asyncio.create_task(tls.recheck_expiry(self._tls, self._say, period_s))
        self._closing(await self._link.check_relay(self.core.address))  # answering at all?
        start = steps.Start(self._verified(), direct=self._link.route.relay is None)
        watch = await self._run(self.core.step(start), report=False)
        if isinstance(watch, steps.Watch):
            self._watch_task = asyncio.create_task(self._watch_forever(watch))
        while not (self._ready.done() or self._fatal.done()):
            # The job's failure settles _ready too; asyncio.wait neither wraps nor cancels it.
            wait_s = max(self.core.ready_by - self._clock(), 0.0)
            await asyncio.wait((self._ready,), timeout=wait_s)
            if not self._ready.done():
                await self._run(self.core.step(steps.DeadlinePassed()), report=False)
                if self.core.over and not self._fatal.done():
                    raise ClusterError(
                        f"this node was closed before the job formed at {self.core.where}"
                    )
        if self._fatal.done():
            raise self._fatal.result()
        return self._ready.result()

    def _verified(self) -> bool:
        """Whether registering may start without probing the scheduler first. With a CRL nothing
        is sent before the scheduler's certificate passed it (grpc cannot check one), here or, a
        moment ago, for another agent of this process; otherwise the probe only runs when an
        attempt fails, to tell "down" from "speaks the other protocol"."""
        return (
            self._tls is None
            or self._tls.revocation is None
            or self._probe.passed_recently(self._link.host, self._link.port, self._tls)
        )

    # -- carrying out the core's actions -------------------------------------------------------

    async def _run(self, actions: list[steps.Action], *, report: bool = True) -> Outcome:
        """Carry out `actions` and those that follow from them, until one is for the caller (an
        accepted stream to read, a call to make again: returned) or the core has nothing more to
        do (None). `report`: a failure goes to `on_fatal` (not while `start` is there to raise
        it)."""
        queue = deque(actions)
        while queue:
            then = await self._do(queue.popleft(), report)
            if not isinstance(then, list):
                return then
            queue.extend(then)
        return None

    async def _do(  # noqa: PLR0911, PLR0912 - a case an action
        self, action: steps.Action, report: bool
    ) -> list[steps.Action] | steps.Watch | steps.RetryCall:
        """One action's I/O: what the core says to do next, or the outcome for the caller."""
        match action:
            case steps.Say(text=text):
                self._say(text)
            case steps.AwaitListening():
                awaited = scheduler_link.await_listening(self.core.address, action)
                return self.core.step(await awaited)
            case steps.Register():
                event = self._link.relayed(await self._register(action))
                return self._registered(self.core.step(event))
            case steps.LeaveRelay(why=why):
                self._closing(self._link.leave_relay(self.core.address, why))
            case steps.CheckScheduler(timeout_s=timeout_s):
                return self.core.step(await self._check_scheduler(timeout_s))
            case steps.Pause(seconds=seconds):
                await asyncio.sleep(seconds)
                return self.core.step(steps.PauseOver())
            case steps.Follow(address=address):
                self._follow(address)
            case steps.Watch():
                self._back.set()
                return action  # the caller reads the stream
            case steps.RetryCall():
                return action  # the caller makes the call again
            case steps.Deliver():
                self._deliver(action)
            case steps.PeerFailed(generation=generation):
                self._peer_failed.set()
                self.generation_end.heard(generation)
            case steps.Fail(error=error):
                self._failed(error, report=report)
            case steps.Released(error=error):
                # Only while start() waits (no topology yet): it raises it; the process exits 0.
                self._failed(error, report=False)
            case steps.Done():
                self._stream_done = True
                self._back.set()
            case steps.SendFinish(timeout_s=timeout_s):
                return self.core.step(await self.send_finish(timeout_s))
            case steps.RetryFinish(after_s=after_s):
                await asyncio.sleep(after_s)
                return self.core.step(steps.FinishRetryDue())
            case steps.HoldFinish(timeout_s=timeout_s):
                self._back.clear()  # (the core held it while registering again: not back yet)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._back.wait(), timeout_s)
                return self.core.step(steps.FinishRetryDue())
            case steps.AwaitFatal(wait_s=wait_s):
                # The cut-off call's reason is on the event stream, an instant behind: raise
                # that rather than a bare "CANCELLED" (none in time: the caller raises its own).
                with contextlib.suppress(asyncio.TimeoutError):
                    raise await asyncio.wait_for(asyncio.shield(self._fatal), wait_s) from None
            case _:  # mypy checks that no action is left out
                assert_never(action)
        return []

    def _registered(self, decided: list[steps.Action]) -> list[steps.Action]:
        """What the core decided on a registration's outcome; an accepted stream it will not
        have read (the node was closed meanwhile) is cancelled."""
        if self._accepted is not None and not any(isinstance(a, steps.Watch) for a in decided):
            self._accepted.cancel()
            self._accepted = None
        return decided

    def _deliver(self, action: steps.Deliver) -> None:
        if action.new_generation:
            self.generation_end.heard(action.topology.generation - 1)
            self._new_generation.set()
            self._new_generation = asyncio.Event()
            self._peer_failed = asyncio.Event()
        if not self._ready.done():
            self._ready.set_result(action.topology)

    def _follow(self, address: str) -> None:
        """Talk to the scheduler at `address` from now on; the old channel's connection goes."""
        self._set_aside(self._link.follow(address))

    async def _check_scheduler(self, timeout_s: float) -> steps.Checked:
        link = self._link
        reach = await self._probe.check(link.host, link.port, self._tls, timeout_s)
        if not reach.ok:  # the relay gone too? (up, the core decides: `LeaveRelay`)
            self._closing(await link.off_lost_relay(self.core.address))
        return steps.Checked(reach.ok, reach.why)

    def _closing(self, closing: Closing | None) -> None:
        if closing is not None:
            self._set_aside(closing)

    def _set_aside(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `work` beside this agent's tasks (cancelled by `close`)."""
        task = asyncio.create_task(work)
        self._aside.add(task)
        task.add_done_callback(self._aside.discard)
        return task

    def _failed(self, error: ClusterError, *, report: bool) -> None:
        self._back.set()
        if self._fatal.done():
            return
        self._fatal.set_result(error)
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # retrieved here: start() raises it
        if report:
            self._on_fatal(error)

    # -- registering ---------------------------------------------------------------------------

    def _signed(self, method: str, request: Any = None) -> membership.Metadata:
        """The metadata of a call of this node: a fresh call proof with a job secret."""
        if self._signer is None:
            return self._metadata
        body = b"" if request is None else request.SerializeToString()
        return self._signer.metadata(method, body)

    async def _ask_challenge(self, action: steps.Register) -> tuple[bytes, str] | steps.Event:
        """The scheduler's challenge for a registration under the job secret (kept for half
        its life), or what came of asking for it."""
        now, held = self._clock(), self._challenge
        if held is not None and held[0] == self.core.address and now - held[3] < TTL_USE_S:
            return held[1], held[2]
        try:
            answer = await self._link.stub.Challenge(
                pb.ChallengeRequest(), timeout=action.attempt_s, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as exc:
            return convert.rpc_failure(exc, self.core.where)
        self._challenge = (self.core.address, answer.challenge, answer.job_id, now)
        return answer.challenge, answer.job_id

    async def _register(self, action: steps.Register) -> steps.Event:
        """One registration attempt: what came of it, as the core's event. (A refusal for a
        stale challenge, after a restart of the scheduler, is met with a new one at once.)"""
        for _ in range(2):
            challenge: tuple[bytes, str] = (b"", "")
            if self._job_secret is not None:
                asked = await self._ask_challenge(action)
                if not isinstance(asked, tuple):
                    return asked
                challenge = asked
            event = await self._register_once(action, challenge)
            if not (isinstance(event, steps.Refused) and event.stale_challenge):
                break
            self._challenge = None
        return event

    async def _register_once(
        self, action: steps.Register, challenge: tuple[bytes, str]
    ) -> steps.Event:
        seq = 0 if self._signer is None else self._signer.floor
        request = pb.WatchRequest(
            register=convert.register_request(
                self.config,
                self.identity,
                self.core.cluster_id,
                self._job_secret,
                challenge=challenge,
                call_seq=seq,
                collectives=self.core.answered,
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
            return convert.rpc_failure(exc, self.core.where)
        except ClusterError as exc:
            call.cancel()
            return steps.Fatal(exc)
        if isinstance(answer, steps.Accepted):
            self._accepted = call
            if self.accepted_at is None:
                self.accepted_at = self._clock()
            return answer
        call.cancel()
        if isinstance(answer, steps.NotLeader):
            # The leader's certificate is checked before registering only with a CRL.
            verified = self._tls is None or self._tls.revocation is None
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
            patient=lambda: self._probe.found_up(self._link.host, self._link.port),
            longer=lambda: self.config.node_timeout_s * bool(self._move and not self._stream_up),
        )
        try:
            return await convert.first_answer(call, self.core.where)
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            if limit.expired:
                raise asyncio.TimeoutError from None
            raise
        finally:
            limit.stop()

    def _answer_late(self, waited_s: float) -> None:
        """The registration has waited `waited_s` for its answer (from a timer: done aside)."""
        self._set_aside(self._run(self.core.step(steps.AnswerLate(waited_s))))

    # -- the stream ----------------------------------------------------------------------------

    async def _watch_forever(self, watch: steps.Watch | None) -> None:
        """Read each accepted stream, and do what its loss calls for, until the core is done."""
        while watch is not None and self._accepted is not None:
            call, self._accepted = self._accepted, None
            lost, move = await self._watch_once(call, watch), self._move
            if lost is not None and move is not None:
                await asyncio.wait((move,))  # the direct stream, superseded, ended first
            if lost is not None and self._accepted is not None:
                continue  # superseded by the stream through the relay come back: read that
            if lost is not None:
                self._closing(await self._link.off_lost_relay(self.core.address, lost))
                lost = self._link.relayed(lost)  # silent, the relay answering: it stays
            then = None if lost is None else await self._run(self.core.step(lost))
            watch = then if isinstance(then, steps.Watch) else None

    async def _watch_once(self, call: Call, watch: steps.Watch) -> steps.Event | None:
        """Read `call` until it says its last word (None) or is lost (what ended it)."""
        beats = (
            Heartbeats(
                lambda: self._link.stub.Heartbeat(metadata=self._signed("Heartbeat")),
                pb.HeartbeatRequest(
                    node_id=self.identity.node_id, incarnation=self.identity.incarnation
                ),
                watch.heartbeat_interval_s,
                self._beats_refused,
            )
            if self.config.heartbeat_enabled
            else None
        )
        silence = (
            Silence(
                call,
                silence_limit(self.config.node_timeout_s, watch.heartbeat_interval_s),
                armed=lambda: self.topology is not None,
            )
            if beats is not None
            else None
        )
        relay = Periodic(self._look_for_relay, RELAY_LOOK_S) if self._link.route.away else None
        self._stream_done, self._stream_up = False, True
        try:
            while not self._stream_done and not self.core.over:
                try:
                    message = await call.read()
                except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
                    if silence is not None and silence.fired:
                        return steps.StreamLost("", silence.limit_s, self._verified())
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    return self._lost(convert.lost(exc))
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
                    await self._run(self.core.step(event))
            return None
        finally:
            self._stream_up = False
            for timer in (relay, silence, beats):
                if timer is not None:
                    timer.stop()
            call.cancel()

    def _beats_refused(self, exc: grpc.aio.AioRpcError) -> bool:
        """A Heartbeat call the scheduler ended: whether it refused this node's certificate
        (revoked, expired), which fails the node with the scheduler's words; any other end is
        the event stream's to tell."""
        if not calls.refused_at_the_edge(exc):
            return False
        error = failures.failure_of(exc).error("heartbeat")
        self._set_aside(self._run(self.core.step(steps.Fatal(error))))
        return True

    def _look_for_relay(self) -> None:
        """While the stream runs direct: is the relay this node lost back (restarted, or
        running again)? Checked aside; the stream moves if it still runs direct then."""
        if self._looking is None and self._link.route.due is not None:
            self._looking = self._set_aside(self._relay_looked_for())

    async def _relay_looked_for(self) -> None:
        why = await self._link.check_lost_relay()
        self._looking = None
        running = self._stream_up and self.topology is not None and not self.core.over
        if why is not None and running and self._move is None and self._link.route.relay_back(why):
            self._move = self._set_aside(self._back_to_relay())

    async def _back_to_relay(self) -> None:
        """Register again, this incarnation, through the relay: the scheduler ends the direct
        stream as superseded, no failure (read to its end, then the new one: no event missed).
        Failed, the node stays direct and looks again. Once the direct stream has ended, the
        scheduler took the move: the relay stream speaks for the node (given up, the node fails)."""
        move = self._link.to_relay(self.core.address)
        event = await self._register(steps.Register(RELAY_MOVE_S, RELAY_MOVE_S))
        self._move = None
        took = isinstance(event, steps.Accepted) and self._accepted is not None
        self._closing(self._link.settle(move, took))

    def _lost(self, event: steps.StreamLost | steps.NotLeader) -> steps.Event:
        return dataclasses.replace(event, verified=self._verified())

    async def _fetched(self, message: pb.Event) -> PeerColumns | None:
        """The whole table that a topology names by its digest, fetched (`peer_table.TABLES`)."""
        if message.WhichOneof("kind") != "topology_ready":
            return None
        digest = message.topology_ready.peers_digest
        if not digest:
            return None
        shared = self._link.route.relay is not None  # the relay shares the host's copy
        return await self.tables.get(
            digest,
            lambda digest: peer_table.fetch(self._link.stub, self._signed, digest, shared=shared),
        )

    def _event(self, message: pb.Event, fetched: PeerColumns | None = None) -> steps.Event | None:
        """`message` as the core's event; a topology's table made whole (inflated, a delta laid
        over the last table heard, or `fetched` by its digest: `peer_table`), MissedChange when
        it cannot be."""
        table = None
        if message.WhichOneof("kind") == "topology_ready":
            table = self._table.take(message.topology_ready, fetched)
        held = self.topology
        try:
            return convert.stream_event(
                message,
                self.config,
                self.identity.node_id,
                table,
                host=self.identity.host,
                last_rank=None if held is None else held.rank,
            )
        except ClusterError as exc:
            return steps.Fatal(exc)

    # -- calls -------------------------------------------------------------------------------

    def _require_topology(self) -> Topology:
        if self.topology is None:
            raise ClusterError("the job has not formed yet: cluster.init() has not returned")
        return self.topology

    async def exchange(
        self,
        op: str,
        value: bytes,
        root: int = 0,
        generation: int | None = None,
        withdrawn: str = "",
    ) -> list[bytes]:
        """One control-plane collective; `op` is "barrier", "allgather" or "broadcast".

        `generation`: the one the caller's work belongs to (a training step that began before
        the job moved on must not take part in the new generation's collectives); default: the
        current one. `withdrawn`: this rank's contribution was refused here, for that reason
        (`value` is empty): it takes the collective's number and fails it for every rank
        (the scheduler's CollectiveError, raised).
        """
        topology = self._require_topology()
        generation = topology.generation if generation is None else generation
        seq = self.core.next_seq(generation)
        node_id = self.identity.node_id
        request = convert.exchange_request(node_id, generation, seq, op, root, value, withdrawn)
        unsent = functools.partial(self.core.collective_unsent, generation, seq)
        answer = await self._calls.unary(op, "Exchange", request, unsent=unsent)
        self.core.collective_answered(generation, seq)
        return list(answer.values)

    async def wait_generation(self, newer_than: int) -> Topology:
        """The topology once its generation is above `newer_than` (the job's failure, if it
        comes first, is raised)."""
        while True:
            topology = self._require_topology()
            if topology.generation > newer_than:
                return topology
            await unless_failed(self._new_generation.wait(), self._fatal)

    async def peer_failed(self, generation: int, wait_s: float) -> bool:
        """Whether a peer of `generation` failed (or the job moved past it), waiting up to
        `wait_s` for the scheduler to say so: an error of a data-plane library (gloo, NCCL)
        often arrives a moment before the scheduler's word."""
        topology = self._require_topology()
        if topology.generation != generation:
            return True
        peer_failed, moved = self._peer_failed, self._new_generation
        waiters = [asyncio.ensure_future(peer_failed.wait()), asyncio.ensure_future(moved.wait())]
        try:
            # FIRST_COMPLETED: either event answers; the default (all) waited out wait_s.
            await unless_failed(
                asyncio.wait(waiters, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED),
                self._fatal,
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
        return peer_failed.is_set() or moved.is_set()

    async def report_checkpoints(
        self, steps: list[int], resumed: convert.Resumed | None = None
    ) -> int:
        """Report the steps held (and, from rank 0, a generation resumed from memory); a step
        every worker holds (0: none), to keep."""
        self._report_seq += 1  # a retry sends the same number: the scheduler takes it once
        held = self.resumed_in or (0 if self.topology is None else self.topology.generation)
        seq = self._report_seq
        request = convert.checkpoints_request(self.identity, steps, held, seq, resumed)
        answer = await self._calls.unary("checkpoint report", "ReportCheckpoints", request)
        return int(answer.held_by_all)

    async def kv_set(self, key: str, value: bytes) -> None:
        await self._calls.unary("kv set", "KvSet", pb.KvSetRequest(key=key, value=value))

    async def kv_get(self, keys: list[str]) -> tuple[list[bytes], list[str]]:
        response = await self._calls.unary("kv get", "KvGet", pb.KvGetRequest(keys=keys))
        return list(response.values), list(response.missing)

    async def kv_wait(self, keys: list[str], timeout_s: float) -> list[bytes]:
        request = pb.KvWaitRequest(keys=keys, timeout_s=timeout_s)
        response = await self._calls.unary("kv wait", "KvWait", request, timeout=timeout_s + 5.0)
        return list(response.values)

    async def kv_add(self, key: str, amount: int) -> int:
        self._add_seq += 1  # a retry sends the same number: the scheduler counts the add once
        request = pb.KvAddRequest(key=key, amount=amount, add_id=self._add_seq)
        response = await self._calls.unary("kv add", "KvAdd", request)
        return int(response.value)

    # -- end ---------------------------------------------------------------------------------

    @property
    def finish_wait_s(self) -> float:
        """The longest `finish()` keeps asking."""
        return self.core.finish_wait_s

    async def finish(self) -> bool:
        """Tell the scheduler this node is done (best effort when the job is over anyway);
        True when it heard. A failure heard meanwhile waits for the answer; the Finish is sent
        again only when it never reached the scheduler (see the core)."""
        try:
            await self._run(self.core.step(steps.FinishSent()))
        except BaseException:
            await self._run(self.core.step(steps.FinishAnswered(heard=False, details="cancelled")))
            raise
        return self.core.finish_heard

    async def send_finish(self, timeout_s: float, failure: str = "") -> steps.Event:
        """One Finish call, waiting up to `timeout_s`: what came of it. With `failure` (the
        first line of the error this process dies of), sent once by the session at exit: the
        node is closed first, so that what the scheduler does about it (it removes the node,
        which ends its stream) is neither said ("lost the scheduler ... training goes on") nor
        acted on (registering again) by a process that is ending."""
        if failure:
            self.core.step(steps.Close())
        request = convert.finish_request(self.identity, failure)
        try:
            await self._link.stub.Finish(
                request, timeout=timeout_s, metadata=self._signed("Finish", request)
            )
        except grpc.aio.AioRpcError as exc:
            why = failures.failure_of(exc)
            return steps.FinishFailed(why.code, why.details, stream_up=self._stream_up)
        return steps.FinishAnswered(heard=True)

    async def close(self) -> None:
        await self._run(self.core.step(steps.Close()))
        for task in (self._watch_task, self._expiry, *self._aside):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await self._link.channel.close(grace=None)
