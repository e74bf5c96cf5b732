"""The leader key belongs to the process that put it, on a real 3-member etcd: a leader whose key
is deleted under it (an operator's `etcdctl del`) steps down at its next keepalive, not at its
next fenced save; a scheduler that advertises the same address as a live leader (two hosts of
one name, both on `--host 0.0.0.0`) leaves that leader's key alone, and takes the key of a
process of this machine that is gone (itself, started again) at once."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest

from cluster.protocol.leadership import Leadership
from cluster.protocol.state_url import parse_state_url
from cluster.scheduler.etcd_client import EtcdConnection
from cluster.scheduler.etcd_election import EtcdElection
from cluster.scheduler.leading import Leading
from cluster.testing import Process
from tests.aio import BOUND_S, eventually
from tests.integration.test_stepping_down import LEASE_S as STEPPING_LEASE_S
from tests.integration.test_stepping_down import leader_and_standby, leads
from tests.procs import PYTHON, ROOT, Procs
from tests.servers.etcd import EtcdCluster

ADDRESS = "sched:8118"  # what both schedulers advertise
LEASE_S = 10  # the holder's key outlives each test's steps by far

# A scheduler process that campaigns once at ADDRESS and keeps its lease while it runs.
HOLDER = """
import asyncio, sys
from cluster.protocol.state_url import parse_state_url
from cluster.scheduler.etcd_client import EtcdConnection
from cluster.scheduler.etcd_election import EtcdElection

async def main():
    connection = EtcdConnection(parse_state_url(sys.argv[1]), timeout_s=2.0)
    election = EtcdElection(connection, sys.argv[2], int(sys.argv[3]))
    assert await election.campaign() is None
    print("leading", flush=True)
    while True:
        await asyncio.sleep(1)  # sleep-ok: the leader's keepalive period, not a wait for an event
        await election.keepalive()

asyncio.run(main())
"""


@pytest.fixture
async def connection(etcd_cluster: EtcdCluster) -> AsyncIterator[EtcdConnection]:
    made = EtcdConnection(parse_state_url(etcd_cluster.state_url()), timeout_s=2.0)
    yield made
    await made.close()


def holder(processes: Procs, etcd: EtcdCluster) -> Process:
    """A live process of this machine that leads at ADDRESS."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [PYTHON, "-c", HOLDER, etcd.state_url(), ADDRESS, str(LEASE_S)]
    proc = processes.start("holder", args, env)
    proc.wait_for_output("leading", 30)
    return proc


async def test_a_scheduler_at_a_live_leaders_address_stands_by_and_takes_over_once_it_is_gone(
    processes: Procs, etcd_cluster: EtcdCluster, connection: EtcdConnection
) -> None:
    proc = holder(processes, etcd_cluster)
    before = await EtcdElection(connection, "reader:1", LEASE_S).leader()
    assert before is not None
    election = EtcdElection(connection, ADDRESS, LEASE_S)
    leading = Leading(election, Leadership(float(LEASE_S), time.monotonic), _nothing, _nothing)
    try:
        for _ in range(2):  # the old rule deleted the key as its own, then won it
            await leading._campaign()  # a candidate's turns of `Leading.run`
        assert not leading.leadership.serving()
        assert await election.leader() == before  # untouched
        proc.signal(signal.SIGKILL)  # gone: its lease has seconds left, its key with it
        proc.wait(BOUND_S)  # and not left a zombie
        await leading._campaign()  # its key is stale: deleted
        await leading._campaign()
        assert leading.leadership.serving()
        assert leading._takeover is not None
        await asyncio.wait_for(leading._takeover, BOUND_S)
    finally:
        await election.close()


async def test_a_leader_whose_key_is_deleted_under_it_steps_down_at_its_next_keepalive(
    etcd_cluster: EtcdCluster,
) -> None:
    async with leader_and_standby(etcd_cluster) as (first, second):
        assert first.ha is not None
        etcd_cluster.etcdctl("del", f"{etcd_cluster.prefix}leader")
        # The standby sees the key go and leads; the first never serves beside it for long.
        await eventually(
            lambda: leads(second) and not leads(first),
            "the deposed leader to step down",
            STEPPING_LEASE_S / 3 + BOUND_S,
        )
        assert "its leader key in etcd was" in first.ha.leadership.reason


async def _nothing(*args: object) -> None:
    pass
