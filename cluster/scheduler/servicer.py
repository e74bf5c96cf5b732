"""The gRPC face of the scheduler: requests to `SchedulerCore` calls, errors to status codes.

No cluster logic lives here. `_STATUS_FOR` is the one place where failures become codes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from cluster.protocol import state
from cluster.protocol.errors import ClusterError, CollectiveError, JobFailedError, PeerFailedError
from cluster.scheduler import convert
from cluster.scheduler.core import EvictedError, SchedulerCore
from cluster.scheduler.exchange import ALLGATHER, BARRIER, BROADCAST
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc

_STATUS_FOR: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (state.UnknownNodeError, grpc.StatusCode.NOT_FOUND),
    (EvictedError, grpc.StatusCode.ABORTED),
    (JobFailedError, grpc.StatusCode.ABORTED),
    (CollectiveError, grpc.StatusCode.FAILED_PRECONDITION),
    (ClusterError, grpc.StatusCode.FAILED_PRECONDITION),
)
_OPS = {
    pb.EXCHANGE_BARRIER: BARRIER,
    pb.EXCHANGE_ALLGATHER: ALLGATHER,
    pb.EXCHANGE_BROADCAST: BROADCAST,
}

Req = TypeVar("Req")
Resp = TypeVar("Resp")


# Trailing metadata naming the error class, for the errors a worker must tell apart from others
# of the same status code.
ERROR_KIND_KEY = "cluster-error"
_NAMED = (PeerFailedError,)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> NoReturn:
    for named in _NAMED:
        if isinstance(exc, named):
            context.set_trailing_metadata(((ERROR_KIND_KEY, named.__name__),))
    for kind, code in _STATUS_FOR:
        if isinstance(exc, kind):
            await context.abort(code, str(exc))
    raise exc


def _mapped(
    handler: Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]]:
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext[Any, Any]) -> Resp:
        try:
            return await handler(self, request, context)
        except (ClusterError, state.UnknownNodeError) as exc:
            await _abort(context, exc)

    wrapper.__name__ = handler.__name__
    return wrapper


class SchedulerServicer(pb_grpc.SchedulerServicer):  # type: ignore[misc]  # untyped base
    def __init__(self, core: SchedulerCore) -> None:
        self._core = core

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
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "Register needs a node_id and a role"
            )
        outcome = await self._core.register(convert.registration_from_pb(request, role))
        settings = self._core.settings
        return convert.register_response(
            outcome, settings.heartbeat_interval_s, settings.node_timeout_s
        )

    async def Watch(
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
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "Watch needs a RegisterRequest or a Hello"
            )
        # The node going away (its process dead, its connection cut) cancels this call, which
        # ends the core's stream and tells the core.
        try:
            async for event in self._core.watch(node_id, incarnation):
                yield event
        except (ClusterError, state.UnknownNodeError) as exc:
            await _abort(context, exc)

    async def Heartbeat(
        self,
        request_iterator: AsyncIterator[pb.HeartbeatRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.HeartbeatResponse:
        try:
            with self._core.heartbeat_call():
                async for beat in request_iterator:
                    self._core.heartbeat(beat.node_id, beat.incarnation)
        except state.UnknownNodeError as exc:
            await _abort(context, exc)
        return pb.HeartbeatResponse()

    @_mapped
    async def Exchange(
        self, request: pb.ExchangeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ExchangeResponse:
        op = _OPS.get(request.op)
        if op is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Exchange needs an op")
        values = await self._core.exchange(
            request.node_id,
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
        self._core.kv.set(request.key, request.value)
        return pb.KvSetResponse()

    @_mapped
    async def KvGet(
        self, request: pb.KvGetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvGetResponse:
        values, missing = self._core.kv.get(list(request.keys))
        return pb.KvGetResponse(values=values, missing=missing)

    @_mapped
    async def KvWait(
        self, request: pb.KvWaitRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvWaitResponse:
        values = await self._core.kv.wait(list(request.keys), request.timeout_s)
        return pb.KvWaitResponse(values=values)

    @_mapped
    async def KvAdd(
        self, request: pb.KvAddRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KvAddResponse:
        return pb.KvAddResponse(value=self._core.kv.add(request.key, request.amount))

    @_mapped
    async def Finish(
        self, request: pb.FinishRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.FinishResponse:
        await self._core.finish(request.node_id, request.incarnation)
        return pb.FinishResponse()

    @_mapped
    async def ReportCheckpoints(
        self, request: pb.ReportCheckpointsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReportCheckpointsResponse:
        await self._core.report_checkpoints(
            request.node_id, request.incarnation, list(request.steps)
        )
        return pb.ReportCheckpointsResponse()

    @_mapped
    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StatusResponse:
        return self._core.status()

    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.JobEvent]:
        try:
            async for event in self._core.journal.follow(request.after_seq, follow=request.follow):
                yield convert.job_event_to_pb(event)
        except ClusterError as exc:
            await _abort(context, exc)


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
