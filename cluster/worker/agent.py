"""The worker's side of the protocol, asynchronous: register, watch, heartbeat, call.

`WorkerAgent` runs on a background event loop (see `cluster.worker.session`). It registers with
retries until MS_TOPO_TIMEOUT, keeps one Watch stream open (sending heartbeats, reading events
and the scheduler's heartbeats), reconnects when the stream is lost, and reports a failure that
ends the job through `on_fatal` exactly once. Every call it makes for the user races against that
failure, so no caller waits on a job that is already over.

With recovery on, losing the scheduler is not a failure: the worker goes on (the data plane does
not pass through the scheduler), reconnects for up to the longer of MS_NODE_TIMEOUT and
MS_TOPO_TIMEOUT, and calls cut off by the scheduler's death are made again once it is back.
A peer's failure is reported and the worker waits for the new generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from cluster.protocol.config import ClusterConfig, Role, is_numeric_node_id, read_job_secret
from cluster.protocol.errors import (
    ClusterError,
    CollectiveError,
    JobFailedError,
    RegistrationRefused,
    SchedulerUnreachableError,
    TopologyTimeoutError,
)
from cluster.protocol.topology import Topology
from cluster.transport import channel as scheduler_channel
from cluster.transport import membership, tls
from cluster.transport.stub import LazyStub
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import peer_table
from cluster.worker.call_errors import call_error
from cluster.worker.identity import NodeIdentity
from cluster.worker.registration import register_request

T = TypeVar("T")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Reconnect fast: workers often start before the scheduler, and every 100 ms of grpc's default
# 1 s first backoff is start-up time lost. The ceiling is low too: a restarted scheduler should
# have every worker back within a fraction of a second of listening. In a large job it grows
# with the job (see reconnect_ceiling_ms).
FIRST_RECONNECT_MS = 100
RECONNECT_CEILING_MS = 300
# A job's nodes try to reconnect at most about this often in all, once backed off: at 8,192
# nodes with a 300 ms ceiling, a scheduler slow to take connections got 27,000 attempts a
# second, each abandoned one taking the place of a connection it could have finished.
RECONNECTS_PER_S = 1000
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # One connection per agent, as a real worker process has (matters when many agents share a
    # process, as in the benchmarks).
    ("grpc.use_local_subchannel_pool", 1),
]


def reconnect_ceiling_ms(nodes: int) -> int:
    """The longest pause between a node's connection attempts in a job of `nodes`."""
    return max(RECONNECT_CEILING_MS, nodes * 1000 // RECONNECTS_PER_S)


def channel_options(nodes: int) -> list[tuple[str, Any]]:
    """The options of a node's channel to the scheduler, in a job of `nodes`."""
    return [
        *scheduler_channel.reconnect_options(FIRST_RECONNECT_MS, reconnect_ceiling_ms(nodes)),
        *_OPTIONS,
    ]


CHANNEL_OPTIONS = channel_options(1)


# Once registered, a worker waits this much longer than MS_TOPO_TIMEOUT for the topology, so
# that the scheduler's own timeout, which names the missing nodes, is what the user sees.
TOPOLOGY_MARGIN_S = 3.0
# Progress lines while waiting: the first after this long, then at this interval.
FIRST_REPORT_AFTER_S = 2.0
REPORT_EVERY_S = 5.0
# How long a call that the scheduler cut off waits for the reason to arrive on the stream.
FATAL_WAIT_S = 2.0
# A call that tries to reach the scheduler is looked at after this long: not connected, the
# scheduler is checked (on the side, see _AnswerLimit), and again every UNREACHED_RECHECK_S.
ATTEMPT_TIMEOUT_S = 3.0
UNREACHED_RECHECK_S = 3.0
# With recovery, a call cut off by the scheduler's death is made again after this pause.
RETRY_PAUSE_S = 0.05
# A Finish waits this long for its answer, then is made again (a finish counts once, so a
# repeat is harmless) while the scheduler's stream is up, for up to MS_NODE_TIMEOUT in all: a
# scheduler busy with a whole job's finishes answers late, and a node that left unanswered
# would be taken for a dead one. (With recovery, the answer also waits for the finish to be
# saved: a scheduler whose saves fail never answers, and the node exits after the wait.)
FINISH_ATTEMPT_S = 5.0
_FINISH_RETRIED = (
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
)


_EXCHANGE_OPS = {
    "barrier": pb.EXCHANGE_BARRIER,
    "allgather": pb.EXCHANGE_ALLGATHER,
    "broadcast": pb.EXCHANGE_BROADCAST,
}


_Call = grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.Event]
_Beats = grpc.aio.StreamUnaryCall[pb.HeartbeatRequest, pb.HeartbeatResponse]


class _StreamLost(Exception):
    def __init__(self, reason: str, *, silent: bool = False, unknown: bool = False) -> None:
        super().__init__(reason)
        self.silent = silent
        self.unknown = unknown


# A silence timer that runs this much later than due means this process did not run meanwhile
# (stopped, or starved of CPU): it could not hear the scheduler either, so that time is not
# counted as the scheduler's silence (what arrived meanwhile is read after the timer runs).
OWN_STALL_S = 1.0


class _Silence:
    """Cancels `call` when nothing has arrived on it for `limit_s` while `armed()`; one timer
    per stream, re-armed only when it runs out (not a task and a timer per message)."""

    def __init__(self, call: _Call, limit_s: float, armed: Callable[[], bool]) -> None:
        self._call = call
        self.limit_s = limit_s
        self._armed = armed
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self.fired = False
        self._timer = self._loop.call_at(self._last + limit_s, self._check)

    def heard(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        late = self._loop.time() - self._timer.when()
        if late > OWN_STALL_S:
            self._last += late
        due = self._last + self.limit_s
        if not self._armed():
            due = max(due, self._loop.time() + self.limit_s)
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self.fired = True
        self._call.cancel()

    def stop(self) -> None:
        self._timer.cancel()


class _AnswerLimit:
    """Cancels a registration `call` that is still unanswered after `answer_s`; calls
    `waiting(seconds)` now and then while it waits, connected, for the answer.

    Its channel not connected after `attempt_s`: with `unreached` it calls `unreached()` (find
    out why, on the side) and goes on waiting, gRPC reconnecting by itself; without it, it
    cancels the call (to be checked and made again). A scheduler that thousands of nodes connect
    to at once takes seconds to accept each (its accept queue full, the SYN sent again), and
    abandoning a call only made another, with a check of its own: a storm of them kept 6,000 of
    8,192 nodes out for minutes, and under it each cancel held its process's loop for a while.
    """

    def __init__(
        self,
        call: _Call,
        channel: grpc.aio.Channel,
        attempt_s: float,
        answer_s: float,
        waiting: Callable[[float], None],
        *,
        unreached: Callable[[], None] | None,
    ) -> None:
        self._call = call
        self._unreached = unreached
        self._channel = channel
        self._waiting = waiting
        self._loop = asyncio.get_running_loop()
        self._started = self._reported = self._loop.time()
        self._answer_by = self._started + max(answer_s, 0.0)
        self.expired = False
        self._timer = self._loop.call_later(max(min(attempt_s, answer_s), 0.0), self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if now >= self._answer_by:
            self.expired = True
            self._call.cancel()
            return
        connected = self._channel.get_state() is grpc.ChannelConnectivity.READY
        if not connected:
            if self._unreached is None:
                self.expired = True
                self._call.cancel()
                return
            self._unreached()
        elif now - self._reported >= REPORT_EVERY_S:
            self._reported = now
            self._waiting(now - self._started)
        every = REPORT_EVERY_S if connected else UNREACHED_RECHECK_S
        self._timer = self._loop.call_at(min(self._answer_by, now + every), self._check)

    def stop(self) -> None:
        self._timer.cancel()


class _Diagnosis:
    """Why a registration's channel is not connected: `check(timeout_s)` run on the side, one
    at a time, while the call waits; a check that finds an error (the scheduler speaks the
    other protocol, refuses this node's certificate) cancels the call, and `error` says why."""

    def __init__(self, check: Callable[[float], Awaitable[bool]], call: _Call) -> None:
        self._check = check
        self._call = call
        self._task: asyncio.Task[None] | None = None
        self.error: ClusterError | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            await self._check(ATTEMPT_TIMEOUT_S)
        except ClusterError as exc:
            self.error = exc
            self._call.cancel()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class _Heartbeats:
    """Writes `beat` every `interval_s` on a Heartbeat stream, opened by `open_stream` at the
    first beat and again after it broke: a timer, and a task only while a beat is on its way
    (not a task per stream that sleeps)."""

    def __init__(
        self, open_stream: Callable[[], _Beats], beat: pb.HeartbeatRequest, interval_s: float
    ) -> None:
        self._open_stream = open_stream
        self._beat = beat
        self._interval_s = interval_s
        self._loop = asyncio.get_running_loop()
        self._stream: _Beats | None = None
        self._sending: asyncio.Task[None] | None = None
        self._timer = self._loop.call_later(interval_s, self._due)

    def _due(self) -> None:
        if self._sending is None or self._sending.done():
            self._sending = self._loop.create_task(self._send())
        self._timer = self._loop.call_later(self._interval_s, self._due)

    async def _send(self) -> None:
        if self._stream is None or self._stream.done():
            self._stream = self._open_stream()
        # A beat that fails is not this node's concern: the event stream tells whether the
        # scheduler is there, and the next beat opens a new stream.
        try:
            await self._stream.write(self._beat)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            self._stream.cancel()
            self._stream = None

    def stop(self) -> None:
        self._timer.cancel()
        if self._sending is not None:
            self._sending.cancel()
        if self._stream is not None:
            self._stream.cancel()


class _Reporter:
    """Prints a waiting message now and then, not on every poll."""

    def __init__(self, say: Callable[[str], None], clock: Callable[[], float]) -> None:
        self._say = say
        self._clock = clock
        self._since = clock()
        self._next = self._since + FIRST_REPORT_AFTER_S

    def reset(self) -> None:
        self._since = self._clock()
        self._next = self._since + FIRST_REPORT_AFTER_S

    def __call__(self, message: str) -> None:
        now = self._clock()
        if now >= self._next:
            self._next = now + REPORT_EVERY_S
            self._say(f"{message} ({now - self._since:.0f} s)")


class WorkerAgent:
    def __init__(
        self,
        config: ClusterConfig,
        identity: NodeIdentity,
        *,
        say: Callable[[str], None],
        on_fatal: Callable[[ClusterError], None],
        clock: Callable[[], float] = time.monotonic,
        expiry_check_period_s: float = tls.EXPIRY_CHECK_PERIOD_S,
        cluster_id: str = "",
    ) -> None:
        """`cluster_id`: the job this node belonged to before its process restarted (its saved
        recovery file), so that a scheduler running another job refuses it."""
        self.config = config
        self.identity = identity
        self._say = say
        self._on_fatal = on_fatal
        self._clock = clock
        self._tls = None if config.tls is None else tls.prepare(config.tls, server=False)
        if self._tls is not None:
            for warning in tls.expiry_warnings(self._tls):
                say(warning)
        self._expiry_check_period_s = expiry_check_period_s
        self._expiry: asyncio.Task[None] | None = None
        self._job_secret = None if config.job_secret is None else read_job_secret(config.job_secret)
        # Every call after the registration says which node makes it, with its credential.
        self._metadata = membership.call_metadata(
            identity.node_id, identity.incarnation, identity.credential
        )
        self._channel = scheduler_channel.open_channel(
            config.sched_address, self._tls, channel_options(config.expected_nodes)
        )
        self._stub = LazyStub(self._channel)
        self._role = pb.ROLE_SERVER if config.role is Role.SERVER else pb.ROLE_WORKER
        self.cluster_id = cluster_id
        self.recovery = config.recovery is not None
        self.topology: Topology | None = None
        self.rejoined = False
        # Why the scheduler could not be reached at the last check ("" when it could).
        self.unreachable = ""
        self.job_finished = False
        self._finished_here = False  # this node's Finish was heard
        # When (this agent's clock) the scheduler accepted this node: a stage of the benchmarks.
        self.accepted_at: float | None = None
        self._stream_up = False  # an accepted event stream is open (the scheduler is there)
        self._heartbeat_interval = config.heartbeat_interval_s
        self._progress = (0, config.expected_nodes)
        # Collectives are numbered per generation: a call made for an old generation (by a
        # step that began before the job moved on) must not shift the new one's numbers.
        self._seqs: dict[int, int] = {}
        self._closing = False
        loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[Topology] = loop.create_future()
        self._fatal: asyncio.Future[ClusterError] = loop.create_future()
        self._watch_task: asyncio.Task[None] | None = None
        self._report = _Reporter(say, clock)
        # Set, and replaced by a fresh one, whenever a new generation arrives.
        self._new_generation = asyncio.Event()
        # Set when a peer of the current generation failed (replaced with each generation).
        self._peer_failed = asyncio.Event()

    @property
    def where(self) -> str:
        return f"the scheduler at {self.config.sched_address}"

    @property
    def reconnect_window_s(self) -> float:
        """How long a formed job's worker tries to get its scheduler back."""
        if self.recovery:
            return max(self.config.node_timeout_s, self.config.topo_timeout_s)
        return self.config.node_timeout_s

    @property
    def fatal(self) -> ClusterError | None:
        return self._fatal.result() if self._fatal.done() else None

    # -- start -------------------------------------------------------------------------------

    async def start(self) -> Topology:
        """Register and wait until the whole topology is ready."""
        started = self._clock()
        deadline = started + self.config.topo_timeout_s
        if self._tls is not None:
            self._expiry = asyncio.create_task(
                tls.recheck_expiry(self._tls, self._say, self._expiry_check_period_s)
            )
        call, accepted = await self._join(deadline)
        self.accepted_at = self._clock()
        self.cluster_id = accepted.cluster_id
        self.rejoined = accepted.rejoined
        self._watch_task = asyncio.create_task(self._watch_forever(call, deadline))
        wait_s = max(deadline + TOPOLOGY_MARGIN_S - self._clock(), 0.0)
        # A failure of the job also settles _ready (see _fail); asyncio.wait neither wraps it in
        # a task nor cancels it when this caller is cancelled.
        await asyncio.wait((self._ready,), timeout=wait_s)
        if self._fatal.done():
            raise self._fatal.result()
        if not self._ready.done():
            registered, expected = self._progress
            raise TopologyTimeoutError(
                f"the job did not form within MS_TOPO_TIMEOUT={self.config.topo_timeout_s:g} s: "
                f"{registered} of {expected} nodes had registered with {self.where}"
            )
        return self._ready.result()

    async def _join(self, deadline: float) -> tuple[_Call, pb.Accepted]:
        """Open this node's stream by registering on it; retry what can clear until `deadline`."""
        self._report.reset()
        # With a CRL nothing is sent before the scheduler's certificate passed it (grpc cannot
        # check one), here or, a moment ago, for another agent of this process; otherwise the
        # check only runs when an attempt fails, to tell "down" from "speaks the other protocol".
        checked = (
            self._tls is None
            or self._tls.revocation is None
            or scheduler_channel.passed_recently(
                self.config.sched_host, self.config.sched_port, self._tls
            )
        )
        self.unreachable = ""
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise TopologyTimeoutError(
                    f"{self.where} did not accept this node in time: "
                    + (
                        self.unreachable
                        or "is it running, and are MS_SCHED_HOST / MS_SCHED_PORT right?"
                    )
                )
            if not checked:
                checked = await self._check(min(remaining, ATTEMPT_TIMEOUT_S))
                if not checked:
                    await asyncio.sleep(min(0.1, max(deadline - self._clock(), 0.0)))
                    continue
            request = pb.WatchRequest(
                register=register_request(
                    self.config, self.identity, self.cluster_id, self._job_secret
                )
            )
            call: _Call = self._stub.Watch(request, wait_for_ready=True)
            try:
                first = await self._answer(call, min(remaining, ATTEMPT_TIMEOUT_S), deadline)
            except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                call.cancel()
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED,
                    # "Internal error from Core": a connection torn down under the call (seen
                    # when a scheduler restarts); trying again is what helps.
                    grpc.StatusCode.INTERNAL,
                ):
                    raise ClusterError(
                        f"{self.where} rejected registration: {exc.details()}"
                    ) from None
                # Down, overloaded, or speaking TLS to our plaintext: the check tells which.
                checked = False
                await asyncio.sleep(min(0.1, max(deadline - self._clock(), 0.0)))
                continue
            if first.HasField("accepted"):
                accepted = first.accepted
                self._heartbeat_interval = accepted.heartbeat_interval_s or self._heartbeat_interval
                self._progress = (accepted.registered, accepted.expected)
                return call, accepted
            call.cancel()
            refusal = first.refused
            if refusal.reason != pb.REFUSAL_NODE_ALIVE:
                raise RegistrationRefused(f"{self.where} refused this node: {refusal.message}")
            self._say(f"registration refused for now: {refusal.message}")
            # A little past the guard's end, so that the next attempt is not early by a hair.
            pause = min(refusal.retry_after_s + 0.02, max(deadline - self._clock(), 0.0))
            await asyncio.sleep(pause)

    async def _check(self, timeout_s: float) -> bool:
        """Whether the scheduler answers in this node's protocol (`check_scheduler`); says why
        not, now and then, while it waits."""
        host, port = self.config.sched_host, self.config.sched_port
        checked = await scheduler_channel.check_scheduler(host, port, self._tls, timeout_s)
        self.unreachable = scheduler_channel.unreachable_reason(host, port)
        self._report(
            f"waiting for {self.where}: {self.unreachable}"
            if self.unreachable
            else f"waiting for {self.where} to answer: it takes connections, but this node's "
            "last attempt got no answer in time (busy or overloaded? see its log)"
        )
        return checked

    async def _answer(self, call: _Call, attempt_s: float, deadline: float) -> pb.Event:
        """The scheduler's answer to the registration on `call`. Reaching the scheduler is
        bounded per attempt; once connected, the answer is awaited until `deadline`: a scheduler
        busy with a burst of registrations answers late, and giving up on a registration it is
        about to accept only makes it do the work again. (A timer that cancels the call, not a
        task and a timeout per attempt.)"""
        # With a CRL, nothing may go to a scheduler whose certificate has not passed it: a call
        # whose channel is not up is made again after a check, not left to connect by itself.
        patient = self._tls is None or self._tls.revocation is None
        diagnosis = _Diagnosis(self._check, call)
        limit = _AnswerLimit(
            call,
            self._channel,
            attempt_s,
            deadline - self._clock(),
            self._answer_late,
            unreached=diagnosis.start if patient else None,
        )
        try:
            return await self._first_answer(call)
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            if diagnosis.error is not None:
                raise diagnosis.error from None
            if limit.expired:
                raise asyncio.TimeoutError from None
            raise
        finally:
            limit.stop()
            diagnosis.stop()

    def _answer_late(self, waited_s: float) -> None:
        self._say(
            f"{self.where} has not answered this node's registration for {waited_s:.0f} s; it "
            "answers once it has saved what the registration changes (see its log if this lasts)"
        )

    async def _first_answer(self, call: _Call) -> pb.Event:
        first = await call.read()
        if first is grpc.aio.EOF:  # type: ignore[attr-defined]  # missing from grpc-stubs
            raise asyncio.InvalidStateError("the scheduler closed the stream without an answer")
        assert isinstance(first, pb.Event)
        if first.WhichOneof("kind") not in ("accepted", "refused"):
            raise ClusterError(f"{self.where} answered registration with {first}")
        return first

    # -- the stream --------------------------------------------------------------------------

    async def _watch_forever(self, call: _Call, topo_deadline: float) -> None:
        current: _Call | None = call
        while current is not None and not self._closing:
            try:
                await self._watch_once(current)
                return
            except _StreamLost as lost:
                if self._closing or self.job_finished:
                    return
                current = await self._reconnect(lost, topo_deadline)
            except ClusterError as exc:
                self._fail(exc)
                return

    async def _watch_once(self, call: _Call) -> None:
        beats = (
            _Heartbeats(
                lambda: self._stub.Heartbeat(metadata=self._metadata),
                pb.HeartbeatRequest(
                    node_id=self.identity.node_id, incarnation=self.identity.incarnation
                ),
                self._heartbeat_interval,
            )
            if self.config.heartbeat_enabled
            else None
        )
        silence = (
            _Silence(call, self.config.node_timeout_s, self._silence_counts)
            if self.config.heartbeat_enabled
            else None
        )
        self._stream_up = True
        try:
            while True:
                try:
                    event = await call.read()
                except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
                    if silence is not None and silence.fired:
                        raise _StreamLost(
                            f"no heartbeat from {self.where} for {silence.limit_s:g} s "
                            "(hung or cut off?)",
                            silent=True,
                        ) from None
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    raise _StreamLost(
                        exc.details() or exc.code().name,
                        unknown=exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED),
                    ) from None
                if silence is not None:
                    silence.heard()
                if event is grpc.aio.EOF:  # type: ignore[attr-defined]  # missing from grpc-stubs
                    raise _StreamLost("the scheduler closed the event stream")
                assert isinstance(event, pb.Event)
                if self._handle(event):
                    return
        finally:
            self._stream_up = False
            if silence is not None:
                silence.stop()
            if beats is not None:
                beats.stop()
            call.cancel()

    def _silence_counts(self) -> bool:
        """Whether the scheduler's silence ends this node's stream: once the job has formed.
        While it forms, a scheduler busy with thousands of registrations can be silent for
        longer than MS_NODE_TIMEOUT, and a node that gave up on its stream would only register
        again, adding to the burst; MS_TOPO_TIMEOUT bounds that wait (a scheduler that died
        breaks the stream at once)."""
        return self.topology is not None

    def _handle(self, event: pb.Event) -> bool:
        """Act on one event; True when the stream has said its last word."""
        kind = event.WhichOneof("kind")
        if kind == "progress":
            self._progress = (event.progress.registered, event.progress.expected)
            if not self._ready.done():
                self._report(
                    f"waiting for the job to form: {event.progress.registered} of "
                    f"{event.progress.expected} nodes registered"
                )
        elif kind == "topology_ready":
            previous = self.topology
            self.topology = self._topology_from(event.topology_ready)
            if previous is not None and self.topology.generation != previous.generation:
                self._say(
                    f"the job is now at generation {self.topology.generation} "
                    f"({self.topology.reason}); training resumes from step "
                    f"{self.topology.rollback_step}"
                )
                self._new_generation.set()
                self._new_generation = asyncio.Event()
                self._peer_failed = asyncio.Event()
            if not self._ready.done():
                self._ready.set_result(self.topology)
        elif kind == "node_failed":
            failed = event.node_failed
            if self.topology is not None and failed.generation == self.topology.generation:
                self._peer_failed.set()
            if self.recovery and failed.node_id != self.identity.node_id:
                self._say(
                    f"rank {failed.rank} (node {failed.node_id!r}) failed: {failed.reason}; the "
                    "job waits for it to rejoin (recovery is on)"
                )
        elif kind == "shutdown":
            if event.shutdown.ok:
                self.job_finished = True
            else:
                self._fail(JobFailedError(f"job failed: {event.shutdown.reason}"))
            return True
        return False

    def _topology_from(self, ready: pb.TopologyReady) -> Topology:
        """This node's view, in O(1) where it can be: the columns stay as they arrived."""
        held = self.topology
        try:
            table = peer_table.table_of(
                ready,
                None
                if held is None or not isinstance(held.table, pb.PeerTable)
                else (held.generation, held.table),
            )
        except peer_table.MissedChange as exc:
            raise _StreamLost(f"{exc}; reconnecting for the whole table") from None
        node_id = self.identity.node_id
        # Workers come first in rank order, then servers: a numeric node id is its rank, so
        # its row is known; any other id is looked up.
        me = -1
        if is_numeric_node_id(node_id):
            guess = int(node_id) + (self.config.worker_num if self._role == pb.ROLE_SERVER else 0)
            if guess < len(table.node_ids) and table.node_ids[guess] == node_id:
                me = guess
        if me < 0:
            try:
                me = list(table.node_ids).index(node_id)
            except ValueError:
                raise ClusterError(f"{self.where} sent a topology without this node") from None
        return Topology(
            generation=ready.generation,
            rank=table.ranks[me],
            local_rank=table.local_ranks[me],
            local_size=table.local_sizes[me],
            size=self.config.worker_num,  # the scheduler refuses a node with another count
            table=table,
            rollback_step=ready.rollback_step,
            reason=ready.reason,
        )

    async def _reconnect(self, lost: _StreamLost, topo_deadline: float) -> _Call | None:
        """The stream back after `lost`; None (after reporting the failure) when it can't be."""
        if self.topology is None:
            # Still forming: MS_TOPO_TIMEOUT bounds everything, and a scheduler that accepted us
            # and then vanished gets MS_NODE_TIMEOUT to come back, like a formed job's.
            deadline = min(topo_deadline, self._clock() + self.config.node_timeout_s)
        elif lost.silent and not self.recovery:
            self._fail(SchedulerUnreachableError(f"{self.where} is unreachable: {lost}"))
            return None
        else:
            window = self.reconnect_window_s
            deadline = self._clock() + window
            self._say(
                f"lost {self.where} ({lost}); training goes on (recovery is on), reconnecting for "
                f"up to {window:g} s"
                if self.recovery
                else f"lost {self.where} ({lost}); reconnecting for up to "
                f"MS_NODE_TIMEOUT={self.config.node_timeout_s:g} s"
            )
        try:
            call, accepted = await self._join(deadline)
        except TopologyTimeoutError:
            why = f" ({self.unreachable})" if self.unreachable else ""
            self._fail(
                SchedulerUnreachableError(
                    f"{self.where} is unreachable: {lost}, and it did not come back within "
                    f"{self.config.node_timeout_s:g} s{why}"
                    if self.topology is not None
                    else f"{self.where} is unreachable: {lost}{why}"
                )
            )
            return None
        except ClusterError as exc:
            self._fail(exc)
            return None
        if self.topology is not None:
            if accepted.rejoined:
                self._say(
                    f"back with {self.where}, which had given this node up: it rejoins the job in "
                    f"generation {accepted.generation}"
                )
            else:
                self._say(f"back with {self.where}")
        return call

    # -- failure -----------------------------------------------------------------------------

    def _fail(self, error: ClusterError) -> None:
        if self._fatal.done() or self._closing or self._finished_here:
            # After this node's Finish was heard, what happens to the others is theirs to
            # report: this process did its part and exits as it means to.
            return
        self._fatal.set_result(error)
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # retrieved here: start() reports it through _guarded
        self._on_fatal(error)

    async def _guarded(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` unless the job fails first; then raise that failure."""
        if self._fatal.done():
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never started: no "was never awaited" warning at exit
            raise self._fatal.result()
        task = asyncio.ensure_future(awaitable)
        racers: list[asyncio.Future[Any]] = [task, self._fatal]
        await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise self._fatal.result()

    # -- calls -------------------------------------------------------------------------------

    def _require_topology(self) -> Topology:
        if self.topology is None:
            raise ClusterError("the job has not formed yet: cluster.init() has not returned")
        return self.topology

    async def _call(self, what: str, rpc: Callable[[], Awaitable[T]]) -> T:
        """Make the call `rpc()` makes; again, with recovery, if the scheduler died during it."""
        while True:
            try:
                return await self._guarded(rpc())
            except grpc.aio.AioRpcError as exc:
                refused = call_error(what, exc)
                if refused is not None:
                    raise refused from None
                if self.recovery and not self._closing:
                    # The scheduler went away mid-call. Ask again: the call waits for the
                    # channel to be back, and the reconnect window ends the wait (as a fatal
                    # failure, which the call above races against).
                    await asyncio.sleep(RETRY_PAUSE_S)
                    continue
                # The scheduler stopping mid-call: its reason is on the event stream, an instant
                # behind; report that rather than a bare "CANCELLED".
                with contextlib.suppress(asyncio.TimeoutError):
                    raise await asyncio.wait_for(
                        asyncio.shield(self._fatal), FATAL_WAIT_S
                    ) from None
                raise CollectiveError(
                    f"{what} failed: {exc.details() or exc.code().name}"
                ) from None

    async def exchange(
        self, op: str, value: bytes, root: int = 0, generation: int | None = None
    ) -> list[bytes]:
        """One control-plane collective; `op` is "barrier", "allgather" or "broadcast".

        `generation`: the one the caller's work belongs to (a training step that began before
        the job moved on must not take part in the new generation's collectives); default: the
        current one.
        """
        topology = self._require_topology()
        generation = topology.generation if generation is None else generation
        seq = self._seqs[generation] = self._seqs.get(generation, 0) + 1
        request = pb.ExchangeRequest(
            node_id=self.identity.node_id,
            generation=generation,
            seq=seq,
            op=_EXCHANGE_OPS[op],
            root=root,
            value=value,
        )
        response = await self._call(
            op,
            lambda: self._stub.Exchange(request, wait_for_ready=True, metadata=self._metadata),
        )
        return list(response.values)

    async def wait_generation(self, newer_than: int) -> Topology:
        """The topology once its generation is above `newer_than` (the job's failure, if it
        comes first, is raised)."""
        while True:
            topology = self._require_topology()
            if topology.generation > newer_than:
                return topology
            await self._guarded(self._new_generation.wait())

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
            await self._guarded(
                asyncio.wait(waiters, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
        return peer_failed.is_set() or moved.is_set()

    async def report_checkpoints(self, steps: list[int]) -> None:
        request = pb.ReportCheckpointsRequest(
            node_id=self.identity.node_id, incarnation=self.identity.incarnation, steps=steps
        )
        await self._call(
            "checkpoint report",
            lambda: self._stub.ReportCheckpoints(
                request, wait_for_ready=True, metadata=self._metadata
            ),
        )

    async def kv_set(self, key: str, value: bytes) -> None:
        request = pb.KvSetRequest(key=key, value=value)
        await self._call(
            "kv set",
            lambda: self._stub.KvSet(request, wait_for_ready=True, metadata=self._metadata),
        )

    async def kv_get(self, keys: list[str]) -> tuple[list[bytes], list[str]]:
        request = pb.KvGetRequest(keys=keys)
        response = await self._call(
            "kv get",
            lambda: self._stub.KvGet(request, wait_for_ready=True, metadata=self._metadata),
        )
        return list(response.values), list(response.missing)

    async def kv_wait(self, keys: list[str], timeout_s: float) -> list[bytes]:
        request = pb.KvWaitRequest(keys=keys, timeout_s=timeout_s)
        response = await self._call(
            "kv wait",
            lambda: self._stub.KvWait(
                request, timeout=timeout_s + 5.0, wait_for_ready=True, metadata=self._metadata
            ),
        )
        return list(response.values)

    async def kv_add(self, key: str, amount: int) -> int:
        request = pb.KvAddRequest(key=key, amount=amount)
        response = await self._call(
            "kv add",
            lambda: self._stub.KvAdd(request, wait_for_ready=True, metadata=self._metadata),
        )
        return int(response.value)

    # -- end ---------------------------------------------------------------------------------

    @property
    def finish_wait_s(self) -> float:
        """The longest `finish()` keeps asking."""
        return max(self.config.node_timeout_s, FINISH_ATTEMPT_S) + FINISH_ATTEMPT_S

    async def finish(self, attempt_s: float = FINISH_ATTEMPT_S) -> bool:
        """Tell the scheduler this node is done (best effort when the job is over anyway);
        True when it heard. An answer that is late is asked for again while the scheduler's
        stream is up (see FINISH_ATTEMPT_S)."""
        if self._fatal.done() or not self.cluster_id:
            return False
        request = pb.FinishRequest(
            node_id=self.identity.node_id, incarnation=self.identity.incarnation
        )
        give_up = self._clock() + self.finish_wait_s - attempt_s
        late = False
        while True:
            try:
                await self._stub.Finish(
                    request, timeout=attempt_s, wait_for_ready=True, metadata=self._metadata
                )
            except grpc.aio.AioRpcError as exc:
                if self.job_finished:  # every node's finish was counted, this one's too
                    self._finished_here = True
                    return True
                if not self._finish_again(exc, give_up):
                    self._say(self._finish_unheard(exc, attempt_s, late))
                    return False
                if not late and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    late = True
                    self._say(
                        f"{self.where} has not confirmed this node's finish within "
                        f"{attempt_s:g} s (busy with the other nodes'"
                        + (
                            ", or its MS_RECOVERY_PATH is full or read-only: see its log)"
                            if self.recovery
                            else ")"
                        )
                        + f"; asking again for up to {give_up - self._clock():.0f} s"
                    )
                continue
            self._finished_here = True
            return True

    def _finish_again(self, exc: grpc.aio.AioRpcError, give_up: float) -> bool:
        """Whether a Finish that failed with `exc` is made again: a late or cut-off answer,
        while the scheduler's stream is up and the wait has not run out."""
        return (
            exc.code() in _FINISH_RETRIED
            and self._stream_up
            and not self._fatal.done()
            and self._clock() < give_up
        )

    def _finish_unheard(self, exc: grpc.aio.AioRpcError, attempt_s: float, late: bool) -> str:
        if late and self.recovery:
            # The scheduler answers once the finish is saved: its saves are failing.
            return (
                f"{self.where} did not confirm that it saved this node's finish (is its "
                "MS_RECOVERY_PATH full or read-only? see its log); this node exits anyway, and "
                "the scheduler ends the job once it can save"
            )
        return f"could not tell {self.where} that this node finished: {exc.details()}"

    async def close(self) -> None:
        self._closing = True
        for task in (self._watch_task, self._expiry):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await self._channel.close(grace=None)
