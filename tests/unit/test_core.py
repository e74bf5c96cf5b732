"""cluster.scheduler.core: what the scheduler does with collectives across generations."""

from __future__ import annotations

import asyncio

import pytest

from cluster.protocol.errors import CollectiveError, PeerFailedError
from cluster.protocol.settings import JobSettings
from cluster.scheduler.core import SchedulerCore
from tests.aio import BOUND_S
from tests.conftest import FakeClock
from tests.credentials import caller, registration

SETTINGS = JobSettings(
    worker_num=2,
    server_num=0,
    node_timeout_s=5.0,
    topo_timeout_s=60.0,
    heartbeat_interval_s=1.0,
    recovery=True,
)


async def test_a_collective_of_an_older_generation_is_a_peer_failure() -> None:
    """A step that began before a rejoin must not join the new generation's collectives."""
    clock = FakeClock(100.0)
    core = SchedulerCore(SETTINGS, clock)
    for node_id in ("0", "1"):
        await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
    core._apply(core.state.disconnect("1", 1))
    clock.now += 6.0
    await asyncio.wait_for(core.register(registration("1", incarnation=2)), BOUND_S)
    assert core.state.generation == 2
    with pytest.raises(PeerFailedError, match=r"belongs to generation 1.*moved on to generation 2"):
        await core.exchange(
            "0", caller("0", 1), generation=1, seq=7, op="allgather", root=0, value=b"x"
        )
    with pytest.raises(CollectiveError, match="generation 3") as info:
        await core.exchange(
            "0", caller("0", 1), generation=3, seq=1, op="allgather", root=0, value=b"x"
        )
    assert type(info.value) is CollectiveError  # not a peer's failure: a misuse
