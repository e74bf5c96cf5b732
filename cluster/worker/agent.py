"""The worker's side of the protocol, asynchronous: register, watch, heartbeat, call.

`WorkerAgent` runs on a background event loop (see `cluster.worker.session`). It registers with
retries until MS_TOPO_TIMEOUT, keeps one Watch stream open (sending heartbeats, reading events
and the scheduler's heartbeats), reconnects when the stream is lost, and reports a failure that
ends the job through `on_fatal` exactly once. Every call it makes for the user races against that
failure, so no caller waits on a job that is already over.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from cluster import channel as scheduler_channel
from cluster import tls
from cluster.config import ClusterConfig, Role, is_numeric_node_id
from cluster.errors import (
    ClusterError,
    CollectiveError,
    JobFailedError,
    RegistrationRefused,
    SchedulerUnreachableError,
    TopologyTimeoutError,
)
from cluster.topology import Topology
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from cluster.worker.identity import NodeIdentity

T = TypeVar("T")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    # Reconnect fast: workers often start before the scheduler, and every 100 ms of grpc's
    # default 1 s first backoff is start-up time lost.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # One connection per agent, as a real worker process has (matters when many agents share a
    # process, as in the benchmarks).
    ("grpc.use_local_subchannel_pool", 1),
]
# Once registered, a worker waits this much longer than MS_TOPO_TIMEOUT for the topology, so
# that the scheduler's own timeout, which names the missing nodes, is what the user sees.
TOPOLOGY_MARGIN_S = 3.0
# Progress lines while waiting: the first after this long, then at this interval.
FIRST_REPORT_AFTER_S = 2.0
REPORT_EVERY_S = 5.0
# How long a call that the scheduler cut off waits for the reason to arrive on the stream.
FATAL_WAIT_S = 2.0
# A call that tries to reach the scheduler gives up on one attempt after this long.
ATTEMPT_TIMEOUT_S = 3.0


_EXCHANGE_OPS = {
    "barrier": pb.EXCHANGE_BARRIER,
    "allgather": pb.EXCHANGE_ALLGATHER,
    "broadcast": pb.EXCHANGE_BROADCAST,
}


_Call = grpc.aio.StreamStreamCall[pb.WatchRequest, pb.Event]


class _StreamLost(Exception):
    def __init__(self, reason: str, *, silent: bool = False, unknown: bool = False) -> None:
        super().__init__(reason)
        self.silent = silent
        self.unknown = unknown


class _Silence:
    """Cancels `call` when nothing has arrived on it for `limit_s`; one timer per stream,
    re-armed only when it runs out (not a task and a timer per message)."""

    def __init__(self, call: _Call, limit_s: float) -> None:
        self._call = call
        self.limit_s = limit_s
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self.fired = False
        self._timer = self._loop.call_at(self._last + limit_s, self._check)

    def heard(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        due = self._last + self.limit_s
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self.fired = True
        self._call.cancel()

    def stop(self) -> None:
        self._timer.cancel()


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
    ) -> None:
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
        self._channel = scheduler_channel.open_channel(
            config.sched_address, self._tls, CHANNEL_OPTIONS
        )
        self._stub = pb_grpc.SchedulerStub(self._channel)
        self._role = pb.ROLE_SERVER if config.role is Role.SERVER else pb.ROLE_WORKER
        self.cluster_id = ""
        self.topology: Topology | None = None
        self.rejoined = False
        self.job_finished = False
        self._heartbeat_interval = config.heartbeat_interval_s
        self._progress = (0, config.expected_nodes)
        self._seq = 0
        self._closing = False
        loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[Topology] = loop.create_future()
        self._fatal: asyncio.Future[ClusterError] = loop.create_future()
        self._watch_task: asyncio.Task[None] | None = None
        self._report = _Reporter(say, clock)

    @property
    def where(self) -> str:
        return f"the scheduler at {self.config.sched_address}"

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
        request = pb.WatchRequest(
            register=pb.RegisterRequest(
                node_id=self.identity.node_id,
                role=self._role,
                host=self.identity.host,
                port=self.identity.port,
                incarnation=self.identity.incarnation,
                worker_num=self.config.worker_num,
                server_num=self.config.server_num,
                cluster_id=self.cluster_id,
            )
        )
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
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise TopologyTimeoutError(
                    f"{self.where} did not accept this node within "
                    f"MS_TOPO_TIMEOUT={self.config.topo_timeout_s:g} s: is it running, and are "
                    "MS_SCHED_HOST / MS_SCHED_PORT right?"
                )
            if not checked:
                checked = await scheduler_channel.check_scheduler(
                    self.config.sched_host,
                    self.config.sched_port,
                    self._tls,
                    min(remaining, ATTEMPT_TIMEOUT_S),
                )
                if not checked:
                    self._report(f"waiting for {self.where} to answer")
                    await asyncio.sleep(min(0.1, max(deadline - self._clock(), 0.0)))
                    continue
            call: _Call = self._stub.Watch(wait_for_ready=True)
            try:
                # Reaching the scheduler is bounded per attempt; once the registration is on its
                # way the answer is awaited until the deadline. A scheduler busy with a burst of
                # registrations answers late, and giving up on a registration it is about to
                # accept only makes it do the work again.
                await asyncio.wait_for(call.write(request), min(remaining, ATTEMPT_TIMEOUT_S))
                first = await asyncio.wait_for(
                    self._first_answer(call), max(deadline - self._clock(), 0.0)
                )
            except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                call.cancel()
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED,
                ):
                    raise ClusterError(
                        f"{self.where} rejected registration: {exc.details()}"
                    ) from None
                checked = False  # down, or speaking TLS to our plaintext: the check tells which
                self._report(f"waiting for {self.where} to answer")
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
            pause = min(max(refusal.retry_after_s, 0.05), max(deadline - self._clock(), 0.0))
            await asyncio.sleep(pause)

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
        beats = asyncio.create_task(self._send_heartbeats(call))
        silence = (
            _Silence(call, self.config.node_timeout_s) if self.config.heartbeat_enabled else None
        )
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
            if silence is not None:
                silence.stop()
            beats.cancel()
            call.cancel()

    async def _send_heartbeats(self, call: _Call) -> None:
        if not self.config.heartbeat_enabled:
            return
        beat = pb.WatchRequest(heartbeat=pb.NodeHeartbeat())
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            while True:
                await asyncio.sleep(self._heartbeat_interval)
                await call.write(beat)

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
            self.topology = self._topology_from(event.topology_ready)
            if not self._ready.done():
                self._ready.set_result(self.topology)
        elif kind == "shutdown":
            if event.shutdown.ok:
                self.job_finished = True
            else:
                self._fail(JobFailedError(f"job failed: {event.shutdown.reason}"))
            return True
        return False

    def _topology_from(self, ready: pb.TopologyReady) -> Topology:
        """This node's view, in O(1) where it can be: the columns stay as they arrived."""
        table = ready.peers
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
        )

    async def _reconnect(self, lost: _StreamLost, topo_deadline: float) -> _Call | None:
        """The stream back after `lost`; None (after reporting the failure) when it can't be."""
        if self.topology is None:
            # Still forming: MS_TOPO_TIMEOUT bounds everything, and a scheduler that accepted us
            # and then vanished gets MS_NODE_TIMEOUT to come back, like a formed job's.
            deadline = min(topo_deadline, self._clock() + self.config.node_timeout_s)
        elif lost.silent:
            self._fail(SchedulerUnreachableError(f"{self.where} is unreachable: {lost}"))
            return None
        else:
            deadline = self._clock() + self.config.node_timeout_s
            self._say(
                f"lost {self.where} ({lost}); reconnecting for up to "
                f"MS_NODE_TIMEOUT={self.config.node_timeout_s:g} s"
            )
        try:
            call, _ = await self._join(deadline)
        except TopologyTimeoutError:
            self._fail(
                SchedulerUnreachableError(
                    f"{self.where} is unreachable: {lost}, and it did not come back within "
                    f"{self.config.node_timeout_s:g} s"
                    if self.topology is not None
                    else f"{self.where} is unreachable: {lost}"
                )
            )
            return None
        except ClusterError as exc:
            self._fail(exc)
            return None
        return call

    # -- failure -----------------------------------------------------------------------------

    def _fail(self, error: ClusterError) -> None:
        if self._fatal.done() or self._closing:
            return
        self._fatal.set_result(error)
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # retrieved here: start() reports it through _guarded
        self._on_fatal(error)

    async def _guarded(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` unless the job fails first; then raise that failure."""
        if self._fatal.done():
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

    async def _call(self, what: str, rpc: Awaitable[T]) -> T:
        try:
            return await self._guarded(rpc)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:
                raise JobFailedError(f"{what} failed: {exc.details()}") from None
            if exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
                # The scheduler stopping mid-call: its reason is on the event stream, an instant
                # behind; report that rather than a bare "CANCELLED".
                with contextlib.suppress(asyncio.TimeoutError):
                    raise await asyncio.wait_for(
                        asyncio.shield(self._fatal), FATAL_WAIT_S
                    ) from None
            raise CollectiveError(f"{what} failed: {exc.details() or exc.code().name}") from None

    async def exchange(self, op: str, value: bytes, root: int = 0) -> list[bytes]:
        """One control-plane collective; `op` is "barrier", "allgather" or "broadcast"."""
        topology = self._require_topology()
        self._seq += 1
        request = pb.ExchangeRequest(
            node_id=self.identity.node_id,
            generation=topology.generation,
            seq=self._seq,
            op=_EXCHANGE_OPS[op],
            root=root,
            value=value,
        )
        response = await self._call(op, self._stub.Exchange(request, wait_for_ready=True))
        return list(response.values)

    async def kv_set(self, key: str, value: bytes) -> None:
        await self._call("kv set", self._stub.KvSet(pb.KvSetRequest(key=key, value=value)))

    async def kv_get(self, keys: list[str]) -> tuple[list[bytes], list[str]]:
        response = await self._call("kv get", self._stub.KvGet(pb.KvGetRequest(keys=keys)))
        return list(response.values), list(response.missing)

    async def kv_wait(self, keys: list[str], timeout_s: float) -> list[bytes]:
        response = await self._call(
            "kv wait",
            self._stub.KvWait(
                pb.KvWaitRequest(keys=keys, timeout_s=timeout_s), timeout=timeout_s + 5.0
            ),
        )
        return list(response.values)

    async def kv_add(self, key: str, amount: int) -> int:
        response = await self._call(
            "kv add", self._stub.KvAdd(pb.KvAddRequest(key=key, amount=amount))
        )
        return int(response.value)

    # -- end ---------------------------------------------------------------------------------

    async def finish(self, timeout_s: float = 5.0) -> None:
        """Tell the scheduler this node is done (best effort when the job is over anyway)."""
        if self._fatal.done() or not self.cluster_id:
            return
        request = pb.FinishRequest(
            node_id=self.identity.node_id, incarnation=self.identity.incarnation
        )
        try:
            await self._stub.Finish(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._say(f"could not tell {self.where} that this node finished: {exc.details()}")

    async def close(self) -> None:
        self._closing = True
        for task in (self._watch_task, self._expiry):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await self._channel.close(grace=None)
