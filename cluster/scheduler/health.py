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

from typing import Any

from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2

from cluster.protocol.errors import ClusterError, CrowdedError
from cluster.scheduler.servicer_edge import CallContext, ServicerEdge, mapped, refuse
from cluster.transport import edge

# Health Watch streams open at once: a few probes and load balancers, not a stranger's flood.
HEALTH_WATCHES = 64


class BoundedHealth:
    """`inner`'s Check, List and Watch, each request refused at `edge_`'s edge when it is not one
    (`mapped`, as the scheduler's own methods), and at most HEALTH_WATCHES Watch streams open."""

    def __init__(self, inner: health_aio.HealthServicer, edge_: ServicerEdge) -> None:
        self._inner = inner
        self._edge = edge_
        self.watching = 0

    def at_edge(self, context: CallContext, method: str, reason: str, problem: str) -> ClusterError:
        return self._edge.at_edge(context, method, reason, problem)

    @mapped
    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: CallContext
    ) -> health_pb2.HealthCheckResponse:
        answer: health_pb2.HealthCheckResponse = await self._inner.Check(request, context)
        return answer

    @mapped
    async def List(self, request: Any, context: CallContext) -> Any:
        return await self._inner.List(request, context)

    async def Watch(self, request: Any, context: CallContext) -> None:
        """grpc_health's Watch, which writes each status with `context.write` until the caller
        ends the stream."""
        try:
            if isinstance(request, edge.Unparsed):
                raise self.at_edge(context, request.method, request.reason, request.message())
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
