"""The gRPC face of the scheduler: requests to `SchedulerCore` calls, errors to status codes.

No cluster logic lives here. Every call first asks the gate for the core that answers
(`cluster.scheduler.gate`): a scheduler that does not lead refuses it, naming the leader. A
failure becomes a status code and its kind in the trailing metadata through the one table of
`cluster.transport.failures`. A code is set on the call, not raised with `context.abort`: an
aborted call's request stays reachable from the exception's frames until the garbage collector
runs, so a flood of refused 4 MiB calls held hundreds of MiB. Who a call comes from is read
from its metadata (`cluster.transport.membership`) and admitted by the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar

import grpc

from cluster.protocol import auth
from cluster.protocol.config import canonical_node_id
from cluster.protocol.display import ERROR_LINE_CHARS, safe
from cluster.protocol.errors import (
    BadRequestError,
    CapacityError,
    ClusterError,
    CrowdedError,
    NotAuthenticatedError,
    NotLeaderError,
    UnknownNodeError,
)
from cluster.scheduler import convert, host_link, member_limits, wiring
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.exchange import ALLGATHER, BARRIER, BROADCAST, Withdrawn
from cluster.scheduler.gate import Gate
from cluster.scheduler.host_calls import HostCalls
from cluster.scheduler.machine import reserve
from cluster.scheduler.machine.events import Kind, Record
from cluster.transport import edge, failures, handlers, membership, stub
from cluster.transport.handlers import Handler, peer_host
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc

_OPS = {
    pb.EXCHANGE_BARRIER: BARRIER,
    pb.EXCHANGE_ALLGATHER: ALLGATHER,
    pb.EXCHANGE_BROADCAST: BROADCAST,
}

# A host link's requests, capped as the calls they stand for (made once, used per attach).
_WATCH_REQUEST = edge.capped("Watch", pb.WatchRequest.FromString)
_FINISH_REQUEST = edge.capped("Finish", pb.FinishRequest.FromString)
Req = TypeVar("Req")
Resp = TypeVar("Resp")


class CallContext(Protocol):
    """What the Watch of a node reads from its call and tells it: a gRPC call's context, or a
    host link's slot (`host_link.SlotContext`)."""

    def peer(self) -> str: ...
    def invocation_metadata(self) -> Any: ...
    def set_trailing_metadata(self, trailing_metadata: Any, /) -> None: ...
    def set_code(self, code: grpc.StatusCode, /) -> None: ...
    def set_details(self, details: str, /) -> None: ...


Ctx = TypeVar("Ctx", bound=CallContext)


def _refuse(context: CallContext, exc: ClusterError) -> None:
    """End the call with the status of `exc` (its handler then returns without an answer)."""
    code, metadata = failures.status_of(exc)
    context.set_trailing_metadata(metadata)
    context.set_code(code)
    context.set_details(str(exc))


def _caller(context: CallContext, method: str, request: Any = None) -> membership.Caller:
    """Who the call speaks for, with what it presents (a call proof covers `request`)."""
    body = bytes if request is None else request.SerializeToString
    return membership.caller(context.invocation_metadata(), method, body)


def _mapped(
    handler: Callable[[Any, Req, Ctx], Awaitable[Resp]],
) -> Callable[[Any, Req, Ctx], Awaitable[Resp | None]]:
    """A unary handler whose ClusterError ends the call with its status, and which refuses a
    request over its method's limit or that did not parse (`edge.Unparsed`) without looking at
    it."""

    async def wrapper(self: Any, request: Req, context: Ctx) -> Resp | None:
        try:
            if isinstance(request, edge.Unparsed):
                raise self.at_edge(context, request.method, request.reason, request.message())
            return await handler(self, request, context)
        except ClusterError as exc:
            _refuse(context, exc)
            return None

    wrapper.__name__ = handler.__name__
    return wrapper


class SchedulerServicer(pb_grpc.SchedulerServicer):  # type: ignore[misc]  # untyped base
    def __init__(self, gate: Gate | SchedulerCore) -> None:
        self._gate = gate if isinstance(gate, Gate) else Gate(gate)
        # The peers of the connections that carry an admitted Watch stream: the members', whose
        # descriptors are never shed (`cluster.scheduler.descriptors`).
        self.member_peers: Counter[str] = Counter()
        # The connection (peer) of each node's admitted stream, and the stream's own token: a
        # host's batched beats are taken only for the nodes whose streams they came beside.
        self.stream_peers: dict[tuple[str, int], tuple[str, object]] = {}
        self.arrivals = handlers.Arrivals(
            per_peer=edge.ARRIVALS_PER_PEER,
            total=edge.ARRIVALS_TOTAL,
            deadline_s=edge.first_message_s,
            peer_of=lambda context: peer_host(context.peer() or ""),
            refuse=self.turned_away,
        )
        self.host_calls = HostCalls(edge.HOST_CALLS_PER_PEER, self.member_peers)
        # Each node's Heartbeat stream (canonical node id -> what ends it): one per node.
        self.beat_streams: dict[str, asyncio.Future[None]] = {}

    def bounded(self, method: str, handler: Handler) -> Handler:
        """`handler`, a member's call, counted to the member it names from its start, while
        its request is on its way (`MemberLimits.call`): past its share, refused at once."""

        def wrap(behavior: Any) -> Any:
            async def call(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                metadata = context.invocation_metadata() or ()
                node_id = next((str(v) for k, v in metadata if k == membership.NODE_ID_KEY), "")
                core = self._gate.core
                if not node_id or core is None:
                    return await behavior(requests, context)
                host = peer_host(context.peer() or "")
                try:
                    with core.bounds.call(node_id[:200], host, method):
                        return await behavior(requests, context)
                except CapacityError as exc:  # past its share of calls: its request unread
                    _refuse(context, exc)
                    return None

            return call

        return handlers.rebuilt(handler, wrap=wrap)

    @property
    def _core(self) -> SchedulerCore:
        """The core that answers this call (NotLeaderError when this scheduler does not lead)."""
        return self._gate.current()

    @_mapped
    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegisterResponse:
        return await self._register(request, context)

    async def _register(
        self, request: pb.RegisterRequest, context: CallContext
    ) -> pb.RegisterResponse:
        role = convert.role_from_pb(request.role)
        if role is None or not request.node_id:
            raise BadRequestError("Register needs a node_id and a role")
        problem = edge.registration_problem(
            request.node_id,
            request.host,
            request.port,
            (request.cluster_id, request.job_id),
            {
                name: (getattr(request, name), most)
                for name, most in edge.REGISTRATION_BLOBS.items()
            },
        )
        if problem is not None:
            raise self.at_edge(context, "Register", "invalid", f"a registration whose {problem}")
        try:
            core = self._core
        except NotLeaderError as exc:
            return convert.not_leader_response(str(exc), exc.leader)
        registration = convert.registration_from_pb(request, role, core.settings.job_secret)
        outcome = await core.register(registration, context.peer())
        settings = core.settings
        return convert.register_response(
            outcome, settings.heartbeat_interval_s, settings.node_timeout_s
        )

    async def turned_away(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str, reason: str, problem: str
    ) -> None:
        """End a call whose request never came in time, or that found too many waiting for
        theirs (`handlers.Arrivals`): counted and told as every refusal at the edge, as
        UNAVAILABLE (CrowdedError), which a real node meets by trying again: a request late
        behind a loaded scheduler's loop, or behind the other calls of its host's relay on one
        connection, is no fault of the node's."""
        _refuse(context, self.at_edge(context, method, reason, problem))

    def at_edge(self, context: CallContext, method: str, reason: str, problem: str) -> ClusterError:
        """A call refused before it reaches the job: counted, told at a bounded rate (the
        journal and the log), its values quoted short and escaped by `problem`'s maker."""
        peer = context.peer() or ""
        count = self._gate.refusals.log(peer, method, reason, problem)
        core = self._gate.core
        if count and core is not None:
            fields: dict[str, object] = {"peer": peer_host(peer), "method": method}
            fields.update(reason=reason, message=problem, count=count)
            core.journal.emit(Record(Kind.REFUSED, fields))
        kinds: dict[str, type[ClusterError]] = {
            "oversized": CapacityError,
            "unauthenticated": NotAuthenticatedError,
            "crowded": CrowdedError,
            "stalled": CrowdedError,
        }
        return kinds.get(reason, BadRequestError)(f"{problem}: refused")

    @_mapped
    async def Challenge(
        self, request: pb.ChallengeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ChallengeResponse:
        try:
            core = self._core
        except NotLeaderError:
            return pb.ChallengeResponse()  # a standby: its refusal names the leader
        return pb.ChallengeResponse(
            challenge=core.state.admission.challenge(),
            job_id=core.state.cluster_id,
            ttl_s=auth.CHALLENGE_TTL_S,
        )

    def _check_reader(self, context: grpc.aio.ServicerContext[Any, Any], method: str) -> None:
        """With a job secret, reading the job needs proof of it: a `cluster-read` proof (which
        `mscluster status` and `events` make from the secret file) or, with mutual TLS, the
        certificate the handshake checked. CLUSTER_READERS_PROVE_SECRET=0 opens the read side;
        a job without a secret is open (docs/design/security.md). Health stays open."""
        core = self._gate.core
        if core is None or core.settings.job_secret is None:
            return  # a standby shows only who leads
        if not core.settings.limits.readers_prove_secret:
            return
        if context.auth_context().get("transport_security_type") == [b"ssl"]:
            return  # mutual TLS: the handshake checked a certificate of the job's CA
        read = membership.read_proof(context.invocation_metadata())
        problem: str | None = "it carries no proof of the job secret"
        if read is not None:
            problem = core.state.admission.read_problem(read[0], read[1], method)
        if problem is not None:
            raise self.at_edge(
                context, method, "unauthenticated", membership.read_refusal(method, problem)
            )

    async def Watch(
        self, request: pb.WatchRequest | edge.Unparsed, context: CallContext
    ) -> AsyncIterator[pb.Event | bytes]:
        try:
            if isinstance(request, edge.Unparsed):
                raise self.at_edge(context, "Watch", request.reason, request.message())
            async for event in self._watch(request, context):
                yield event
        except ClusterError as exc:
            _refuse(context, exc)

    async def _watch(
        self, request: pb.WatchRequest, context: CallContext
    ) -> AsyncIterator[pb.Event | bytes]:
        kind = request.WhichOneof("kind")
        if kind == "register":
            answer = await self._register(request.register, context)
            if answer.HasField("refused"):
                if answer.refused.reason == pb.REFUSAL_NOT_LEADER:
                    # Said where a host's relay reads it too (it parses no answer).
                    context.set_trailing_metadata(((failures.LEADER_KEY, answer.refused.leader),))
                yield pb.Event(refused=answer.refused)
                return
            yield pb.Event(accepted=answer.accepted)
            node_id, incarnation = request.register.node_id, request.register.incarnation
        elif kind == "hello":
            node_id, incarnation = request.hello.node_id, request.hello.incarnation
        else:
            raise BadRequestError("Watch needs a RegisterRequest or a Hello")
        caller = _caller(context, "Watch", request) if kind == "hello" else None
        # The node going away (its process dead, its connection cut) cancels this call, which
        # ends the core's stream and tells the core. (A registration just accepted is answered
        # by the core that accepted it, even if a step-down came in between: its stream ends
        # at once then, with NotLeaderError.)
        peer = reserve.peer_address(context.peer() or "")
        member, stream = False, (peer, object())
        try:
            events = self._core.watch(
                node_id, incarnation, caller, by_digest=request.table_by_digest
            )
            async for event in events:
                if not member:  # admitted: its connection is a member's while the stream lasts
                    member = True
                    self.member_peers[peer] += 1
                    self.stream_peers[(node_id, incarnation)] = stream
                yield event
        finally:
            if member:
                self.member_peers[peer] -= 1
                if self.member_peers[peer] <= 0:
                    del self.member_peers[peer]
                if self.stream_peers.get((node_id, incarnation)) is stream:
                    del self.stream_peers[(node_id, incarnation)]

    async def Heartbeat(
        self,
        request_iterator: AsyncIterator[pb.HeartbeatRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.HeartbeatResponse | None:
        """A node's beats (`_beats`), until it ends them or opens a newer Heartbeat stream:
        one stream per node, the newest (this one then ends, answered)."""
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            core = self._core
            with core.heartbeat_call():
                reading = asyncio.ensure_future(
                    self._beats(request_iterator, context, _caller(context, "Heartbeat"), ended)
                )
                try:
                    await asyncio.wait((reading, ended), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    reading.cancel()
                if reading.done() and not reading.cancelled():
                    reading.result()
        except ClusterError as exc:
            _refuse(context, exc)
            return None
        return pb.HeartbeatResponse()

    async def _beats(
        self,
        request_iterator: AsyncIterator[pb.HeartbeatRequest | edge.Unparsed],
        context: grpc.aio.ServicerContext[Any, Any],
        caller: membership.Caller,
        ended: asyncio.Future[None],
    ) -> None:
        """The beats of one Heartbeat call. A call proof is good for one call, and its number
        is taken once: the first beat is admitted with it, and the later beats of this call for
        the same node (else refused). Once admitted, and within its node's rate of stream opens
        (`MemberLimits.stream_open`, else refused), the call is its node's Heartbeat stream,
        and ends the one the node had (`ended`)."""
        admitted: tuple[str, int] | None = None
        node = ""
        try:
            async for beat in request_iterator:
                if isinstance(beat, edge.Unparsed):
                    raise self.at_edge(context, "Heartbeat", beat.reason, beat.message())
                who = (beat.node_id, beat.incarnation)
                self._core.heartbeat(*who, None if who == admitted else caller)
                if admitted is None:
                    await self._core.bounds.stream_open(
                        beat.node_id, peer_host(context.peer() or "")
                    )
                    node = canonical_node_id(beat.node_id)
                    older = self.beat_streams.get(node)
                    if older is not None:
                        _settle(older)  # superseded: it ends, answered
                    self.beat_streams[node] = ended
                admitted = who
        finally:
            if node and self.beat_streams.get(node) is ended:
                del self.beat_streams[node]

    async def HostBeats(
        self,
        request_iterator: AsyncIterator[pb.HostBeatsRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.HostBeatsResponse | None:
        """A relay's batched beats (`_host_beats`), until the relay ends them or the scheduler
        stops (`HostCalls.end`)."""
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            # Not a node's call (`heartbeat_call`): a relay's stream lasts as long as the relay,
            # and the end of the job does not wait for it.
            self._core  # noqa: B018 - a standby refuses it (NotLeaderError)
            with self._host_call(context, "HostBeats", functools.partial(_settle, ended)):
                reading = asyncio.ensure_future(self._host_beats(request_iterator, context))
                try:
                    await asyncio.wait((reading, ended), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    reading.cancel()
                if reading.done():
                    reading.result()
        except ClusterError as exc:
            _refuse(context, exc)
            return None
        return pb.HostBeatsResponse()

    async def _host_beats(
        self,
        request_iterator: AsyncIterator[pb.HostBeatsRequest | edge.Unparsed],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """Each named node beats if its admitted stream is on this call's connection (no proof
        of its own: the stream's admission was the node's)."""
        peer = reserve.peer_address(context.peer() or "")
        async for beats in request_iterator:
            if isinstance(beats, edge.Unparsed):
                raise self.at_edge(context, "HostBeats", beats.reason, beats.message())
            for node in beats.nodes:
                key = (node.node_id, node.incarnation)
                held = self.stream_peers.get(key)
                if held is not None and held[0] == peer:
                    with contextlib.suppress(UnknownNodeError):
                        self._core.heartbeat(*key, None)

    async def HostWatch(
        self,
        request_iterator: AsyncIterator[pb.HostUp],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.HostDown]:
        """A relay's one stream for its workers' Watch streams (`host_link`): each attached slot
        runs as the Watch call it stands for, with the worker's own request and proof. It ends
        when the relay's side and every slot have, or when the scheduler stops (`_end_link`)."""
        link = host_link.HostLink(edge.HOST_SLOTS)
        reading = asyncio.ensure_future(self._host_up(request_iterator, context, link))
        # A request that is refused ends the call, and with it every slot.
        reading.add_done_callback(lambda done: link.close() if _failed(done) else None)
        try:
            with self._host_call(context, "HostWatch", functools.partial(_end_link, reading, link)):
                async for batch in link.batches(reading):
                    for down in batch:
                        yield pb.HostDown(
                            slots=down.slots,
                            event=down.event or b"",
                            ended=[_slot_end(end) for end in down.ended],
                        )
                if _failed(reading):
                    reading.result()
        except ClusterError as exc:
            _refuse(context, exc)
        finally:
            reading.cancel()
            link.close()

    @contextlib.contextmanager
    def _host_call(
        self, context: CallContext, method: str, end: Callable[[], None]
    ) -> Iterator[None]:
        """Around a host call (`HostCalls`), which `end()` ends: turned away, as crowded, past
        the address's share of calls that speak for nobody."""
        peer = context.peer() or ""
        address, connection = peer_host(peer), reserve.peer_address(peer)
        if not self.host_calls.open(address, connection, end):
            raise self.at_edge(
                context,
                method,
                "crowded",
                f"{self.host_calls.memberless(address)} host calls from {address} carry no "
                f"admitted Watch stream already, the most the scheduler holds "
                f"({self.host_calls.per_peer}); try again",
            )
        try:
            yield
        finally:
            self.host_calls.close(address, connection, end)

    async def _host_up(
        self,
        request_iterator: AsyncIterator[pb.HostUp | edge.Unparsed],
        context: grpc.aio.ServicerContext[Any, Any],
        link: host_link.HostLink,
    ) -> None:
        """The relay's messages, each read when what the link holds for its writer is under the
        link's bounds (`HostLink.room`): a relay that does not read is not read either."""
        peer = context.peer() or ""
        async for up in request_iterator:
            if isinstance(up, edge.Unparsed):
                raise self.at_edge(context, "HostWatch", up.reason, up.message())
            if up.WhichOneof("kind") != "batch":
                self._host_up_one(up, peer, link)
            elif len(up.batch.ups) > edge.HOST_BATCH_UPS:
                raise BadRequestError(
                    f"a HostWatch batch of {len(up.batch.ups)}: at most {edge.HOST_BATCH_UPS}"
                )
            else:
                for one in up.batch.ups:
                    self._host_up_one(one, peer, link, batched=True)
            await link.room()

    def _host_up_one(
        self, up: pb.HostUp, peer: str, link: host_link.HostLink, *, batched: bool = False
    ) -> None:
        """One attach, finish or detach of a host link (`batched`: one of a batch). An attach is
        bounded on its own (the call's message limit bounds a batch)."""
        kind = up.WhichOneof("kind")
        if kind == "detach":
            link.detach(up.detach)
            return
        if kind not in ("attach", "finish"):
            raise BadRequestError(
                "a HostWatch batch holds attaches, finishes and detaches"
                if batched
                else "HostWatch needs an attach, a finish, a detach or a batch of them"
            )
        attached: pb.HostAttach = getattr(up, kind)
        if attached.ByteSize() > edge.HOST_ATTACH_BYTES:
            raise BadRequestError(
                f"a HostWatch {kind} of {attached.ByteSize()} bytes: at most "
                f"{edge.HOST_ATTACH_BYTES}"
            )
        slot = host_link.SlotContext(peer, stub.metadata_of(attached.metadata))
        events: AsyncIterator[bytes]
        if kind == "attach":
            watch = self.Watch(_WATCH_REQUEST(attached.request), slot)
            events = (wiring.event_bytes(event) async for event in watch)
        else:
            events = self._finished(_FINISH_REQUEST(attached.request), slot)
        link.attach(attached.slot, events, slot)

    async def _finished(
        self, request: pb.FinishRequest | edge.Unparsed, slot: host_link.SlotContext
    ) -> AsyncIterator[bytes]:
        """A worker's Finish on its host's link: its answer goes in the slot's end."""
        answer = await self.Finish(request, slot)  # type: ignore[arg-type]  # Unparsed: _mapped
        if answer is not None:
            slot.answer = answer.SerializeToString()
        return
        yield b""  # an async generator, as a slot runs

    @_mapped
    async def Exchange(
        self, request: pb.ExchangeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ExchangeResponse:
        op = _OPS.get(request.op)
        if op is None:
            raise BadRequestError("Exchange needs an op")
        value, withdrawn = request.value, request.withdrawn
        if withdrawn and value:
            raise BadRequestError("an Exchange that withdraws carries no value")
        member_limits.request_bytes(len(value) + len(withdrawn))
        contribution = Withdrawn(withdrawn) if withdrawn else value
        values = await self._core.exchange(
            request.node_id,
            _caller(context, "Exchange", request),
            generation=request.generation,
            seq=request.seq,
            op=op,
            root=request.root,
            value=contribution,
        )
        return pb.ExchangeResponse(values=values)

    @_mapped
    async def KvSet(
        self, request: pb.KvSetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvSetResponse:
        key, value = request.key, request.value
        member_limits.request_bytes(len(key) + len(value))
        await self._core.kv_set(_caller(context, "KvSet", request), key, value)
        return pb.KvSetResponse()

    @_mapped
    async def KvGet(
        self, request: pb.KvGetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvGetResponse:
        store = self._core.kv_for(_caller(context, "KvGet", request))
        values, missing = store.get(list(request.keys))
        return pb.KvGetResponse(values=values, missing=missing)

    @_mapped
    async def PeerTable(
        self, request: pb.PeerTableRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PeerTableResponse:
        table = self._core.peer_table(_caller(context, "PeerTable", request), request.digest)
        return pb.PeerTableResponse(peers_zlib=table)

    @_mapped
    async def KvWait(
        self, request: pb.KvWaitRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvWaitResponse:
        caller = _caller(context, "KvWait", request)
        values = await self._core.kv_wait(caller, list(request.keys), request.timeout_s)
        return pb.KvWaitResponse(values=values)

    @_mapped
    async def KvAdd(
        self, request: pb.KvAddRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvAddResponse:
        caller = _caller(context, "KvAdd", request)
        value = await self._core.kv_add(caller, request.key, request.amount, request.add_id)
        return pb.KvAddResponse(value=value)

    @_mapped
    async def Finish(self, request: pb.FinishRequest, context: CallContext) -> pb.FinishResponse:
        caller = _caller(context, "Finish", request)
        failure = safe(request.failure, ERROR_LINE_CHARS) if request.failure else ""
        await self._core.finish(request.node_id, request.incarnation, caller, failure)
        return pb.FinishResponse()

    @_mapped
    async def ReportCheckpoints(
        self, request: pb.ReportCheckpointsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReportCheckpointsResponse:
        held_by_all = await self._core.report_checkpoints(
            request.node_id,
            request.incarnation,
            list(request.steps),
            _caller(context, "ReportCheckpoints", request),
            convert.memory_resume_of(request.resumed) if request.HasField("resumed") else None,
            (request.generation, request.report_seq),
        )
        return pb.ReportCheckpointsResponse(held_by_all=held_by_all)

    @_mapped
    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StatusResponse:
        self._check_reader(context, "Status")
        try:
            core = self._core
            response = convert.status_to_pb(core.state, core.now(), core.told(), core.saving())
            if core.journal.last_memory_resume is not None:
                response.memory_resume.CopyFrom(
                    convert.memory_resume_to_pb(core.journal.last_memory_resume)
                )
        except NotLeaderError:
            if self._gate.leadership is None:
                # Without standbys, a scheduler answers for no job only as it stops (it leaves
                # the job to resume, saving what is pending first, or stands down), or, with
                # standbys, before it has joined their election.
                raise NotLeaderError(
                    "not the leader: this scheduler is stopping (or has yet to start) and "
                    "answers for no job now; with recovery, a scheduler started again on the "
                    "job's state resumes it"
                ) from None
            response = pb.StatusResponse()  # a standby: no job of its own, only who leads
        if self._gate.leadership is not None:
            response.leadership.CopyFrom(convert.standing_to_pb(self._gate.standing()))
        return response

    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.JobEvent]:
        try:
            if isinstance(request, edge.Unparsed):
                raise self.at_edge(context, "WatchEvents", request.reason, request.message())
            self._check_reader(context, "WatchEvents")
            async for event in self._core.journal.follow(request.after_seq, follow=request.follow):
                yield convert.job_event_to_pb(event)
        except ClusterError as exc:
            _refuse(context, exc)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _end_link(reading: asyncio.Future[None], link: host_link.HostLink) -> None:
    """End a host link as the scheduler stops: the relay's messages are read no more, and the
    link ends once its slots have (their ends written), or `host_link.END_S` later, closed."""
    reading.cancel()
    asyncio.get_running_loop().call_later(host_link.END_S, link.close)


def _failed(reading: asyncio.Future[None]) -> bool:
    """Whether the link's reader ended with an error (a refused request)."""
    return not reading.cancelled() and reading.exception() is not None


def _slot_end(end: host_link.SlotEnd) -> pb.SlotEnd:
    return pb.SlotEnd(
        slot=end.slot,
        code=end.code.value[0],
        details=end.details,
        trailing=stub.metadata_pb(end.trailing),
        answer=end.answer,
    )


def add_to_server(servicer: SchedulerServicer, server: grpc.aio.Server) -> None:
    """The scheduler's methods on `server`, bounded at the edge (`wiring`)."""
    wiring.add_to_server(servicer, server, pb_grpc.add_SchedulerServicer_to_server)
