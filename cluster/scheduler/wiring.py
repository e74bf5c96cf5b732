"""How the scheduler's servicer goes on a gRPC server: each method's request capped at the edge
(`cluster.transport.edge.capped`), each call's first message awaited within its bounds
(`handlers.Arrivals`), a member's call refused unread when it names no member (`named`) and
counted to its member once its request came (`counted`), and Watch writing the events the core
serialized once as they are."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc_health.v1 import health_pb2_grpc

from cluster.transport import edge, handlers

if TYPE_CHECKING:
    from cluster.scheduler.health import BoundedHealth
    from cluster.scheduler.servicer import SchedulerServicer

# The members' calls: named members only (`named`), each counted to its member (`counted`).
MEMBER_CALLS = frozenset(
    {"Exchange", "KvSet", "KvGet", "KvWait", "KvAdd", "ReportCheckpoints", "PeerTable"}
)


class _Message(Protocol):
    def SerializeToString(self) -> bytes: ...  # protobuf's name


# The generated `add_SchedulerServicer_to_server`: the servicer module passes it in, so that the
# wire format is imported by the edge's few modules only (tests/unit/test_contracts.py).
Register = Callable[[Any, Any], None]


def event_bytes(event: _Message | bytes) -> bytes:
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


def add_to_server(servicer: SchedulerServicer, server: grpc.aio.Server, register: Register) -> None:
    """`register` (the generated `add_SchedulerServicer_to_server`), with each handler bounded
    as the module says and Watch writing pre-serialized events as they are."""
    capture = _Capture()
    register(servicer, capture)
    for method, handler in list(capture.handlers.items()):
        deserializer = handler.request_deserializer
        assert deserializer is not None  # the generated handlers all have one
        capped = handlers.rebuilt(
            handler,
            request_deserializer=edge.capped(method, deserializer),
            response_serializer=event_bytes if method == "Watch" else None,
        )
        member = method in MEMBER_CALLS
        arriving = servicer.arrivals.wrap(
            method, servicer.counted(method, capped) if member else capped
        )
        capture.handlers[method] = servicer.named(method, arriving) if member else arriving
    _add(server, "cluster.v1.Scheduler", capture.handlers)


def add_health_to_server(
    health: BoundedHealth, server: grpc.aio.Server, arrivals: handlers.Arrivals
) -> None:
    """The health service, each request capped (`edge.HEALTH_LIMITS`) and awaited within its
    time among the calls that wait for theirs (`arrivals`), as the scheduler's own methods."""
    capture = _Capture()
    health_pb2_grpc.add_HealthServicer_to_server(health, capture)
    for method, handler in list(capture.handlers.items()):
        deserializer = handler.request_deserializer
        assert deserializer is not None  # the generated handlers all have one
        named = f"Health.{method}"
        capped = handlers.rebuilt(handler, request_deserializer=edge.capped(named, deserializer))
        capture.handlers[method] = arrivals.wrap(named, capped)
    _add(server, "grpc.health.v1.Health", capture.handlers)


def _add(
    server: grpc.aio.Server, service: str, methods: dict[str, grpc.RpcMethodHandler[Any, Any]]
) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, methods),))
    server.add_registered_method_handlers(service, methods)  # type: ignore[attr-defined]  # missing from grpc-stubs
