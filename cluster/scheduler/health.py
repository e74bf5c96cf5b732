"""The gRPC health service (`grpc.health.v1.Health`) behind the scheduler's edge.

Anyone who reaches the port may ask it, a job's secret or not (a probe holds no credential), so
it meets the edge the scheduler's own methods meet (`wiring.add_health_to_server`): its request
capped at `edge.HEALTH_LIMITS` bytes and refused unread past them or unparsed, awaited within
its time and counted among the calls that wait for theirs (`handlers.Arrivals`). A `Watch`
stream lives until its caller ends it, so at most HEALTH_WATCHES are open at once; past that a
new one is refused (UNAVAILABLE: a probe tries again). Without these bounds, 200 Watch streams
naming a service of 1 MiB each held 875 MiB of the scheduler's memory for as long as their
caller liked. grpc_health's own servicer keeps the statuses and answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2

from cluster.protocol.errors import ClusterError, CrowdedError
from cluster.scheduler.servicer_edge import CallContext, ServicerEdge, refuse
from cluster.transport import edge

# Health Watch streams open at once: a few probes and load balancers, not a stranger's flood.
HEALTH_WATCHES = 64


class BoundedHealth:
    """`inner`'s Check, List and Watch, each request refused at `edge_`'s edge when it is not one,
    and at most HEALTH_WATCHES Watch streams open."""

    def __init__(self, inner: health_aio.HealthServicer, edge_: ServicerEdge) -> None:
        self._inner = inner
        self._edge = edge_
        self.watching = 0

    async def Check(
        self, request: Any, context: CallContext
    ) -> health_pb2.HealthCheckResponse | None:
        answer: health_pb2.HealthCheckResponse | None = await self._unary(
            "Check", request, context, self._inner.Check
        )
        return answer

    async def List(self, request: Any, context: CallContext) -> Any:
        return await self._unary("List", request, context, self._inner.List)

    async def _unary(
        self,
        method: str,
        request: Any,
        context: CallContext,
        answer: Callable[[Any, CallContext], Awaitable[Any]],
    ) -> Any:
        try:
            self._parsed(request, context, method)
        except ClusterError as exc:
            refuse(context, exc)
            return None
        return await answer(request, context)

    async def Watch(self, request: Any, context: CallContext) -> None:
        """grpc_health's Watch, which writes each status with `context.write` until the caller
        ends the stream."""
        try:
            self._parsed(request, context, "Watch")
            if self.watching >= HEALTH_WATCHES:
                raise CrowdedError(
                    f"{self.watching} health Watch streams are open, the most the scheduler "
                    "holds; try again, or ask Check"
                )
        except ClusterError as exc:
            refuse(context, exc)
            return
        self.watching += 1
        try:
            await self._inner.Watch(request, context)
        finally:
            self.watching -= 1

    def _parsed(self, request: Any, context: CallContext, method: str) -> None:
        """Raise the edge's refusal of a request that is not one (over its limit, unparsed)."""
        if isinstance(request, edge.Unparsed):
            raise self._edge.at_edge(context, f"Health.{method}", request.reason, request.message())
