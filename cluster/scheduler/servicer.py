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

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from cluster.protocol.errors import BadRequestError, ClusterError, NotLeaderError
from cluster.scheduler import convert
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.exchange import ALLGATHER, BARRIER, BROADCAST
from cluster.scheduler.gate import Gate
from cluster.transport import failures, membership
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc

_OPS = {
    pb.EXCHANGE_BARRIER: BARRIER,
    pb.EXCHANGE_ALLGATHER: ALLGATHER,
    pb.EXCHANGE_BROADCAST: BROADCAST,
}

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _refuse(context: grpc.aio.ServicerContext[Any, Any], exc: ClusterError) -> None:
    """End the call with the status of `exc` (its handler then returns without an answer)."""
    code, metadata = failures.status_of(exc)
    context.set_trailing_metadata(metadata)
    context.set_code(code)
    context.set_details(str(exc))


def _caller(context: grpc.aio.ServicerContext[Any, Any]) -> membership.Caller:
    return membership.caller(context.invocation_metadata())


def _mapped(
    handler: Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp | None]]:
    async def wrapper(
        self: Any, request: Req, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Resp | None:
        try:
            return await handler(self, request, context)
        except ClusterError as exc:
            _refuse(context, exc)
            return None

    wrapper.__name__ = handler.__name__
    return wrapper


class SchedulerServicer(pb_grpc.SchedulerServicer):  # type: ignore[misc]  # untyped base
    def __init__(self, gate: Gate | SchedulerCore) -> None:
        self._gate = gate if isinstance(gate, Gate) else Gate(gate)

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
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegisterResponse:
        role = convert.role_from_pb(request.role)
        if role is None or not request.node_id:
            raise BadRequestError("Register needs a node_id and a role")
        try:
            core = self._core
        except NotLeaderError as exc:
            return convert.not_leader_response(str(exc), exc.leader)
        outcome = await core.register(convert.registration_from_pb(request, role))
        settings = core.settings
        return convert.register_response(
            outcome, settings.heartbeat_interval_s, settings.node_timeout_s
        )

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.Event | bytes]:
        try:
            async for event in self._watch(request, context):
                yield event
        except ClusterError as exc:
            _refuse(context, exc)

    async def _watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.Event | bytes]:
        kind = request.WhichOneof("kind")
        if kind == "register":
            answer = await self._register(request.register, context)
            if answer.HasField("refused"):
                yield pb.Event(refused=answer.refused)
                return
            yield pb.Event(accepted=answer.accepted)
            node_id, incarnation = request.register.node_id, request.register.incarnation
        elif kind == "hello":
            node_id, incarnation = request.hello.node_id, request.hello.incarnation
        else:
            raise BadRequestError("Watch needs a RegisterRequest or a Hello")
        caller = _caller(context) if kind == "hello" else None
        # The node going away (its process dead, its connection cut) cancels this call, which
        # ends the core's stream and tells the core. (A registration just accepted is answered
        # by the core that accepted it, even if a step-down came in between: its stream ends
        # at once then, with NotLeaderError.)
        async for event in self._core.watch(node_id, incarnation, caller):
            yield event

    async def Heartbeat(
        self,
        request_iterator: AsyncIterator[pb.HeartbeatRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.HeartbeatResponse | None:
        caller = _caller(context)
        try:
            core = self._core
            with core.heartbeat_call():
                async for beat in request_iterator:
                    self._core.heartbeat(beat.node_id, beat.incarnation, caller)
        except ClusterError as exc:
            _refuse(context, exc)
            return None
        return pb.HeartbeatResponse()

    @_mapped
    async def Exchange(
        self, request: pb.ExchangeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ExchangeResponse:
        op = _OPS.get(request.op)
        if op is None:
            raise BadRequestError("Exchange needs an op")
        values = await self._core.exchange(
            request.node_id,
            _caller(context),
            generation=request.generation,
            seq=request.seq,
            op=op,
            root=request.root,
            value=request.value,
        )
        return pb.ExchangeResponse(values=values)

    @_mapped
    async def KvSet(
        self, request: pb.KvSetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvSetResponse:
        await self._core.kv_set(_caller(context), request.key, request.value)
        return pb.KvSetResponse()

    @_mapped
    async def KvGet(
        self, request: pb.KvGetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvGetResponse:
        values, missing = self._core.kv_for(_caller(context)).get(list(request.keys))
        return pb.KvGetResponse(values=values, missing=missing)

    @_mapped
    async def KvWait(
        self, request: pb.KvWaitRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvWaitResponse:
        store = self._core.kv_for(_caller(context))
        values = await store.wait(list(request.keys), request.timeout_s)
        return pb.KvWaitResponse(values=values)

    @_mapped
    async def KvAdd(
        self, request: pb.KvAddRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvAddResponse:
        value = await self._core.kv_add(_caller(context), request.key, request.amount)
        return pb.KvAddResponse(value=value)

    @_mapped
    async def Finish(
        self, request: pb.FinishRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.FinishResponse:
        await self._core.finish(request.node_id, request.incarnation, _caller(context))
        return pb.FinishResponse()

    @_mapped
    async def ReportCheckpoints(
        self, request: pb.ReportCheckpointsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReportCheckpointsResponse:
        held_by_all = await self._core.report_checkpoints(
            request.node_id, request.incarnation, list(request.steps), _caller(context)
        )
        return pb.ReportCheckpointsResponse(held_by_all=held_by_all)

    @_mapped
    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StatusResponse:
        try:
            response = self._core.status()
        except NotLeaderError:
            response = pb.StatusResponse()  # a standby: no job of its own, only who leads
        if self._gate.leadership is not None:
            response.leadership.CopyFrom(self._gate.leadership_pb())
        return response

    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.JobEvent]:
        try:
            async for event in self._core.journal.follow(request.after_seq, follow=request.follow):
                yield convert.job_event_to_pb(event)
        except ClusterError as exc:
            _refuse(context, exc)


def _event_bytes(event: pb.Event | bytes) -> bytes:
    """Watch's serializer: an event that goes to every stream is serialized once, by the core."""
    return event if isinstance(event, bytes) else event.SerializeToString()


class _Capture:
    """Stands in for the server while the generated code registers the handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come again, by name, below

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.handlers = dict(handlers)


def add_to_server(servicer: SchedulerServicer, server: grpc.aio.Server) -> None:
    """`add_SchedulerServicer_to_server`, with Watch writing pre-serialized events as they are."""
    capture = _Capture()
    pb_grpc.add_SchedulerServicer_to_server(servicer, capture)
    watch = capture.handlers["Watch"]
    capture.handlers["Watch"] = grpc.unary_stream_rpc_method_handler(
        servicer.Watch,
        request_deserializer=watch.request_deserializer,
        response_serializer=_event_bytes,
    )
    service = "cluster.v1.Scheduler"
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, capture.handlers),)
    )
    server.add_registered_method_handlers(service, capture.handlers)  # type: ignore[attr-defined]  # missing from grpc-stubs
