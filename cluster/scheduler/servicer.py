"""The gRPC face of the scheduler: requests to `SchedulerCore` calls, errors to status codes.

No cluster logic lives here. Every call first asks the gate for the core that answers
(`cluster.scheduler.gate`): a scheduler that does not lead refuses it, naming the leader. What
runs around each handler, the refusals at the edge, the books of the members' connections and
a failure's status code set on its call, is `cluster.scheduler.servicer_edge`'s, the base of
`SchedulerServicer`; here are the handlers, call family by call family: membership (Register,
Challenge, Watch, Heartbeat), a host's relay (HostBeats, HostWatch), the collectives and the
key-value store, the Finish and checkpoint reports, and the read side (Status, WatchEvents).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

import grpc

from cluster.protocol import auth
from cluster.protocol.config import canonical_node_id
from cluster.protocol.display import ERROR_LINE_CHARS, safe
from cluster.protocol.errors import (
    BadRequestError,
    ClusterError,
    NotLeaderError,
    UnknownNodeError,
)
from cluster.scheduler import convert, host_link, wiring
from cluster.scheduler.exchange import ALLGATHER, BARRIER, BROADCAST, Withdrawn
from cluster.scheduler.machine import reserve
from cluster.scheduler.servicer_edge import (
    CallContext,
    ServicerEdge,
    caller_of,
    mapped,
    refuse,
)
from cluster.transport import edge, failures, membership, stub
from cluster.transport.handlers import peer_host
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


class SchedulerServicer(ServicerEdge, pb_grpc.SchedulerServicer):  # type: ignore[misc]  # untyped base
    """The scheduler's calls, each a thin handler (`ServicerEdge`: what runs around them)."""

    @mapped
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
            request.cluster_version,
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

    @mapped
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

    async def Watch(
        self, request: pb.WatchRequest | edge.Unparsed, context: CallContext
    ) -> AsyncIterator[pb.Event | bytes]:
        try:
            if isinstance(request, edge.Unparsed):
                raise self.at_edge(context, "Watch", request.reason, request.message())
            async for event in self._watch(request, context):
                yield event
        except ClusterError as exc:
            refuse(context, exc)

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
        caller = caller_of(context, "Watch", request) if kind == "hello" else None
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
                    self._beats(request_iterator, context, caller_of(context, "Heartbeat"), ended)
                )
                try:
                    await asyncio.wait((reading, ended), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    reading.cancel()
                if reading.done() and not reading.cancelled():
                    reading.result()
        except ClusterError as exc:
            refuse(context, exc)
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
            refused = self.refused_relay(context, "HostBeats")
            if refused is not None:
                raise refused
            with self._host_call(context, "HostBeats", functools.partial(_settle, ended)):
                reading = asyncio.ensure_future(self._host_beats(request_iterator, context))
                try:
                    await asyncio.wait((reading, ended), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    reading.cancel()
                if reading.done():
                    reading.result()
        except ClusterError as exc:
            refuse(context, exc)
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
        refused = self.refused_relay(context, "HostWatch")
        if refused is not None:  # every slot would end with it: the link does at once
            refuse(context, refused)
            return
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
            refuse(context, exc)
        finally:
            reading.cancel()
            link.close()

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

    @mapped
    async def Exchange(
        self,
        requests: AsyncIterator[pb.ExchangeRequest | edge.Unparsed],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.ExchangeResponse | None:
        core = await self.value_core(requests)
        request, value = await self.joined(requests, context, "Exchange")
        op = _OPS.get(request.op)
        if op is None:
            raise BadRequestError("Exchange needs an op")
        withdrawn = request.withdrawn
        if withdrawn and value:
            raise BadRequestError("an Exchange that withdraws carries no value")
        contribution = Withdrawn(withdrawn) if withdrawn else value
        try:
            values = await core.exchange(
                request.node_id,
                caller_of(context, "Exchange", request),
                generation=request.generation,
                seq=request.seq,
                op=op,
                root=request.root,
                value=contribution,
            )
        except ClusterError as exc:  # refused with its reason, where it has one
            refuse(context, exc, convert.exchange_refusal(exc))
            return None
        return pb.ExchangeResponse(values=values)

    @mapped
    async def KvSet(
        self,
        requests: AsyncIterator[pb.KvSetRequest | edge.Unparsed],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.KvSetResponse:
        core = await self.value_core(requests)
        request, value = await self.joined(requests, context, "KvSet")
        await core.kv_set(caller_of(context, "KvSet", request), request.key, value)
        return pb.KvSetResponse()

    @mapped
    async def KvGet(
        self, request: pb.KvGetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvGetResponse:
        store = self._core.kv_for(caller_of(context, "KvGet", request))
        values, missing = store.get(list(request.keys))
        return pb.KvGetResponse(values=values, missing=missing)

    @mapped
    async def PeerTable(
        self, request: pb.PeerTableRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PeerTableResponse:
        table = self._core.peer_table(caller_of(context, "PeerTable", request), request.digest)
        return pb.PeerTableResponse(peers_zlib=table)

    @mapped
    async def KvWait(
        self, request: pb.KvWaitRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvWaitResponse:
        caller = caller_of(context, "KvWait", request)
        values = await self._core.kv_wait(caller, list(request.keys), request.timeout_s)
        return pb.KvWaitResponse(values=values)

    @mapped
    async def KvAdd(
        self, request: pb.KvAddRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvAddResponse:
        caller = caller_of(context, "KvAdd", request)
        value = await self._core.kv_add(caller, request.key, request.amount, request.add_id)
        return pb.KvAddResponse(value=value)

    @mapped
    async def Finish(self, request: pb.FinishRequest, context: CallContext) -> pb.FinishResponse:
        caller = caller_of(context, "Finish", request)
        failure = safe(request.failure, ERROR_LINE_CHARS) if request.failure else ""
        await self._core.finish(request.node_id, request.incarnation, caller, failure)
        return pb.FinishResponse()

    @mapped
    async def ReportCheckpoints(
        self, request: pb.ReportCheckpointsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReportCheckpointsResponse:
        held_by_all = await self._core.report_checkpoints(
            request.node_id,
            request.incarnation,
            list(request.steps),
            caller_of(context, "ReportCheckpoints", request),
            convert.memory_resume_of(request.resumed) if request.HasField("resumed") else None,
            (request.generation, request.report_seq),
        )
        return pb.ReportCheckpointsResponse(held_by_all=held_by_all)

    @mapped
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
            refuse(context, exc)


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
