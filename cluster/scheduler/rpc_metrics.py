"""RPCs by service, method and status code, and the latency of unary calls: a grpc.aio
interceptor.

Installed only when metrics are on. It counts every call the scheduler serves when it ends
(`cluster_rpc_requests_total{service,method,code}`), and times the unary ones
(`cluster_rpc_duration_seconds{service,method}`); a stream (Watch, Heartbeat, WatchEvents) lives as
long as its node, so its length says nothing of latency and is not timed. Heartbeats are
messages on a stream, not calls: they cost the interceptor nothing.

Labels are bounded: `service` is a service the scheduler serves (`cluster.v1.Scheduler`, and
gRPC's health service `grpc.health.v1.Health`, whose `Watch` is not the scheduler's), `method` one
of its methods (a call to any other has no handler and is not counted), `code` a gRPC status
code name.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from cluster.transport import handlers

# The methods that are streams: one lives as long as a node, a follower or a host's relay does
# (`Exchange` and `KvSet` take their request in pieces, but are answered at once: timed).
STREAMS = frozenset({"Watch", "Heartbeat", "WatchEvents", "HostBeats", "HostWatch"})
RPC_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30)

if TYPE_CHECKING:  # generic in grpc-stubs only
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
    Context = grpc.aio.ServicerContext[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor
    Context = Any


def _code(context: Context, error: BaseException | None) -> str:
    """The call's status code as it ended: as set (abort, set_code), else OK, CANCELLED when
    the client went away, UNKNOWN for an exception that set none."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if error is None:
        return "OK"
    return "CANCELLED" if isinstance(error, asyncio.CancelledError) else "UNKNOWN"


class RpcMetrics(_Interceptor):
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "cluster_rpc_requests",
            "Calls the scheduler served, by service, method and status code, counted when they "
            "end.",
            ["service", "method", "code"],
            registry=registry,
        )
        self.duration = Histogram(
            "cluster_rpc_duration_seconds",
            "Seconds the scheduler took to answer a unary call, by service and method.",
            ["service", "method"],
            buckets=RPC_SECONDS_BUCKETS,
            registry=registry,
        )

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(details)
        if handler is None:
            return None
        # "/cluster.v1.Scheduler/Watch": the service, then the method
        service, _, method = str(details.method).lstrip("/").rpartition("/")
        return self._wrapped(handler, service, method)

    def _wrapped(
        self, handler: grpc.RpcMethodHandler[Any, Any], service: str, method: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        requests, duration = self.requests, self.duration

        def unary(behavior: Any, timed: bool) -> Any:
            async def call(request: Any, context: Context) -> Any:
                started = time.perf_counter()
                error: BaseException | None = None
                try:
                    return await behavior(request, context)
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    if timed:
                        duration.labels(service, method).observe(time.perf_counter() - started)
                    requests.labels(service, method, _code(context, error)).inc()

            return call

        def streaming(behavior: Any) -> Any:
            async def call(request: Any, context: Context) -> Any:
                error: BaseException | None = None
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    requests.labels(service, method, _code(context, error)).inc()

            return call

        # Streams live as long as a node does: counted, not timed. (The server takes every
        # method as a streaming-request one, `handlers.Arrivals`: the kind does not tell.)
        timed = method not in STREAMS

        def wrap(behavior: Any) -> Any:
            if inspect.isasyncgenfunction(behavior):
                return streaming(behavior)
            return unary(behavior, timed)

        return handlers.rebuilt(handler, wrap=wrap)
