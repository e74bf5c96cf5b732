"""SIGTERM to the leader of a job with standbys (etcd) while the job's end is being saved: the
job is over, not handed over. A real 3-member etcd, a leader in this process whose saves take
SLOW_SAVE_S (a slow store), and a job that failed just before: the leader waits for its end to
land and ends with it (exit 1), never saying it handed over a job that is over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cluster.protocol.state_url import parse_state_url
from cluster.scheduler import JobStore, SchedulerServer, stores
from cluster.scheduler.etcd_store import EtcdStore
from cluster.storage.state_store import Written
from tests.aio import BOUND_S, eventually
from tests.scrape import form, settings
from tests.servers.etcd import EtcdCluster

LEASE_S = 2
SLOW_SAVE_S = 0.5


@pytest.fixture
def slow_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save of the state takes SLOW_SAVE_S more (a slow or distant etcd)."""
    real = EtcdStore.save

    async def slow(self: EtcdStore, snapshot: dict[str, Any], token: str) -> Written:
        await asyncio.sleep(SLOW_SAVE_S)  # sleep-ok: the fault
        return await real(self, snapshot, token)

    monkeypatch.setattr(EtcdStore, "save", slow)


@contextlib.asynccontextmanager
async def leading(etcd: EtcdCluster) -> AsyncIterator[SchedulerServer]:
    """A scheduler with standbys (none started) that leads a formed job."""
    store = await stores.open_etcd(parse_state_url(etcd.state_url()), "127.0.0.1:0", LEASE_S)
    assert isinstance(store, EtcdStore)
    async with SchedulerServer(
        settings(recovery=True), store=JobStore(store, store.election)
    ) as server:
        await eventually(lambda: server.gate.standing().leading, "the scheduler to lead", 30)
        await form(server)
        yield server


def handed_over(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "handing the job over" in r.getMessage()]


@pytest.mark.usefixtures("slow_saves")
async def test_sigterm_while_the_jobs_end_is_saved_ends_the_leader_with_it(
    etcd_cluster: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cluster.scheduler")
    async with leading(etcd_cluster) as server:
        core = server.core
        core.abort("a server died")
        assert not core.done.is_set()  # its save is on the way
        server.request_handover("scheduler stopped by SIGTERM")
        assert await asyncio.wait_for(server.wait_done(), BOUND_S) is False
        assert core.done.is_set()
    assert handed_over(caplog) == []


@pytest.mark.usefixtures("slow_saves")
async def test_an_end_that_lands_while_handing_over_is_the_result(
    etcd_cluster: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A call under way ends the job while the leader hands it over: the end lands in the
    save that handing over waits for, and the nodes are told. The job is over: its result."""
    caplog.set_level(logging.INFO, logger="cluster.scheduler")
    async with leading(etcd_cluster) as server:
        assert server.ha is not None
        core = server.core
        core.abort("a server died")
        await asyncio.wait_for(server.ha.hand_over("scheduler stopped by SIGTERM"), BOUND_S)
        assert core.done.is_set()
        assert await asyncio.wait_for(server.wait_done(), BOUND_S) is False
    assert handed_over(caplog) == []
