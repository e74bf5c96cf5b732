"""The health service meets the scheduler's edge: anyone may ask it (a probe holds no
credential), so its request is capped and a Watch stream, which lives until its caller ends it,
is one of at most HEALTH_WATCHES. Before, 200 Watch streams naming a service of 1 MiB held
875 MiB of the scheduler's memory for as long as their caller liked. A real server on loopback."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.scheduler import SchedulerServer
from cluster.scheduler.health import HEALTH_WATCHES
from tests.aio import BOUND_S
from tests.scrape import settings

SERVING = health_pb2.HealthCheckResponse.SERVING


async def test_a_health_request_over_its_limit_is_refused_unread() -> None:
    async with (
        SchedulerServer(settings()) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=BOUND_S)
        assert answer.status == SERVING
        big = health_pb2.HealthCheckRequest(service="x" * 1_000_000)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health.Check(big, timeout=BOUND_S)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # as any method's
        assert "a Health.Check request of 1,000,004 bytes; the scheduler takes at most 256" in (
            str(refused.value.details())
        )
        watch = health.Watch(big, timeout=BOUND_S)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await watch.read()
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_at_most_so_many_health_watches_are_open_at_once() -> None:
    async with (
        SchedulerServer(settings()) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        open_ = [health.Watch(request) for _ in range(HEALTH_WATCHES)]
        for watch in open_:
            assert (await asyncio.wait_for(watch.read(), BOUND_S)).status == SERVING
        one_more = health.Watch(request)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(one_more.read(), BOUND_S)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert f"{HEALTH_WATCHES} health Watch streams are open" in str(refused.value.details())
        open_.pop().cancel()
        answer = await health.Check(request, timeout=BOUND_S)  # Check is not a Watch
        assert answer.status == SERVING

        async def a_new_watch_is_taken() -> bool:
            watch = health.Watch(request)
            try:
                return (await asyncio.wait_for(watch.read(), BOUND_S)).status == SERVING
            except grpc.aio.AioRpcError:
                return False
            finally:
                watch.cancel()

        for _ in range(int(BOUND_S * 10)):  # the cancelled stream's end reaches the server
            if await a_new_watch_is_taken():
                break
            await asyncio.sleep(0.1)  # sleep-ok: polling, bounded by BOUND_S
        else:
            pytest.fail("no Watch was taken once one of the open ones ended")
        for watch in open_:
            watch.cancel()
