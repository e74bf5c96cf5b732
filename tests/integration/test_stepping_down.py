"""What a scheduler that does not lead shows: two schedulers of one job in this process, on a real
3-member etcd, with metrics on. A standby that never led, and a leader whose lease ended (revoked
in etcd, as it ends for a leader stopped or cut off past it) and that stepped down, have no job of
their own: their /metrics carry no job gauges (only the new leader's do, so sums over the
schedulers count the job once) and `cluster_leader 0`; a reader following the old leader's
events is ended at once with the not-leader status that a standby answers every call with."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

import grpc

from cluster.protocol.errors import NotLeaderError
from cluster.protocol.state_url import parse_state_url
from cluster.scheduler import JobStore, SchedulerServer, stores
from cluster.scheduler.etcd_client import EtcdConnection
from cluster.scheduler.etcd_store import EtcdStore
from cluster.transport.failures import failure_of
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.aio import BOUND_S, eventually
from tests.scrape import ON, form, scrape, settings, value
from tests.servers.etcd import EtcdCluster

LEASE_S = 2


@contextlib.asynccontextmanager
async def scheduler(etcd: EtcdCluster) -> AsyncIterator[SchedulerServer]:
    """A scheduler with standbys (`mscluster scheduler --state-url`), on port 0."""
    store = await stores.open_etcd(parse_state_url(etcd.state_url()), "127.0.0.1:0", LEASE_S)
    assert isinstance(store, EtcdStore)
    job = JobStore(store, store.election)
    async with SchedulerServer(settings(recovery=True), store=job, observe=ON) as server:
        yield server


def leads(server: SchedulerServer) -> bool:
    return server.gate.standing().leading


async def revoke_lease(etcd: EtcdCluster, server: SchedulerServer) -> None:
    """End the scheduler's lease in etcd (its leader key goes with it)."""
    assert server.ha is not None
    lease = server.ha.election.lease_id
    assert lease is not None
    connection = EtcdConnection(parse_state_url(etcd.state_url()), timeout_s=2.0)
    try:
        await connection.call(lambda c: c.revoke_lease(lease), "revoke the leader's lease")
    finally:
        await connection.close()


def without_a_job(seen: Iterable[str]) -> list[str]:
    """The job's series found in a scrape (none where the scheduler does not lead)."""
    job = ("cluster_job_", "cluster_nodes", "cluster_generation", "cluster_member_")
    return [name for name in seen if name.startswith(job)]


@contextlib.asynccontextmanager
async def leader_and_standby(etcd: EtcdCluster) -> AsyncIterator[tuple[SchedulerServer, ...]]:
    """Two schedulers of one job: the first leads the formed job, the second stands by."""
    async with scheduler(etcd) as first:
        await eventually(lambda: leads(first), "the first scheduler to lead", 30)
        async with scheduler(etcd) as second:
            await eventually(
                lambda: second.gate.standing().leader == first.gate.address,
                "the second to stand by behind the first",
                30,
            )
            await form(first)
            yield first, second


async def test_only_the_scheduler_that_leads_shows_the_job(etcd_cluster: EtcdCluster) -> None:
    async with leader_and_standby(etcd_cluster) as (first, second):
        job = first.core.state.cluster_id
        seen = await scrape(second)  # never led: the job-less core it started with
        assert value(seen, "cluster_leader") == 0
        assert without_a_job(seen) == []
        seen = await scrape(first)
        assert value(seen, "cluster_leader") == 1
        assert value(seen, "cluster_job_info", cluster_id=job) == 1
        assert value(seen, "cluster_nodes", role="worker", state="alive") == 2

        await revoke_lease(etcd_cluster, first)
        await eventually(lambda: leads(second), "the second to lead", LEASE_S + BOUND_S)
        await eventually(lambda: not leads(first), "the first to step down", LEASE_S + BOUND_S)
        seen = await scrape(first)  # stepped down: its core, frozen, is not shown
        assert value(seen, "cluster_leader") == 0
        assert without_a_job(seen) == []
        seen = await scrape(second)
        assert value(seen, "cluster_leader") == 1
        assert value(seen, "cluster_job_info", cluster_id=job) == 1
        assert value(seen, "cluster_nodes", role="worker", state="alive") == 2  # awaited


async def test_a_leader_that_steps_down_ends_its_event_followers_as_not_the_leader(
    etcd_cluster: EtcdCluster,
) -> None:
    async with leader_and_standby(etcd_cluster) as (first, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{first.port}") as channel:
            follower = pb_grpc.SchedulerStub(channel).WatchEvents(
                pb.WatchEventsRequest(follow=True)
            )
            assert (await asyncio.wait_for(follower.read(), BOUND_S)).event == "started"
            await revoke_lease(etcd_cluster, first)

            async def read_to_the_end() -> None:
                while await follower.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
                    pass

            try:
                await asyncio.wait_for(read_to_the_end(), LEASE_S + BOUND_S)
            except grpc.aio.AioRpcError as exc:
                ended = exc
            else:
                raise AssertionError("the follower ended without a status")
        assert ended.code() is grpc.StatusCode.UNAVAILABLE
        assert failure_of(ended).kind is NotLeaderError
        assert "not the leader" in str(ended.details())
