"""The election on a real etcd (`cluster.scheduler.etcd_election`, `cluster.scheduler.leading`):
a scheduler keeps one lease while it runs, so a campaign may put the leader key on a lease last
refreshed a while ago (a standby's, between keepalives; a leader's that stepped down while etcd
was away). The new leader must not believe its lease lasts longer than etcd will keep it. And a
scheduler whose registration failed registers when it next asks for its lease."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cluster.protocol.errors import EtcdRefused
from cluster.protocol.leadership import KEEPALIVES_PER_LEASE, Leadership
from cluster.protocol.state_url import parse_state_url
from cluster.scheduler.etcd_client import EtcdConnection
from cluster.scheduler.etcd_election import EtcdElection
from cluster.scheduler.leading import Leading
from tests.aio import BOUND_S
from tests.servers.etcd import EtcdCluster

LEASE_S = 5
ADDRESS = "127.0.0.1:1"


@pytest.fixture
async def connection(etcd_cluster: EtcdCluster) -> AsyncIterator[EtcdConnection]:
    made = EtcdConnection(parse_state_url(etcd_cluster.state_url()), timeout_s=2.0)
    yield made
    await made.close()


async def ttl_of(connection: EtcdConnection, lease: int) -> int:
    """The whole seconds etcd says `lease` has left (a LeaseTimeToLive request)."""
    info = await connection.call(lambda c: c.get_lease_info(lease), "read the lease's TTL")
    return int(info.TTL)


async def aged(connection: EtcdConnection, lease: int, left_s: int) -> None:
    """Until etcd says `lease` has `left_s` seconds or fewer left."""
    deadline = time.monotonic() + LEASE_S + BOUND_S
    while await ttl_of(connection, lease) > left_s:
        assert time.monotonic() < deadline, "the lease did not age"
        await asyncio.sleep(0.05)  # sleep-ok: polls the lease's TTL in etcd, bounded above


async def test_a_term_won_on_a_lease_held_before_ends_no_later_than_the_lease_in_etcd(
    connection: EtcdConnection,
) -> None:
    election = EtcdElection(connection, ADDRESS, LEASE_S)
    leadership = Leadership(float(LEASE_S), time.monotonic)
    said: list[str] = []

    async def lead() -> None:
        said.append("lead")

    async def step_down(why: str) -> None:
        said.append(why)

    leading = Leading(election, leadership, lead, step_down)
    try:
        lease = await election.ensure_lease()  # every scheduler holds one from its start
        await aged(connection, lease, left_s=2)
        await leading._campaign()  # one turn of `Leading.run` as a candidate
        assert leading._takeover is not None  # the takeover runs beside the keepalives
        await asyncio.wait_for(leading._takeover, BOUND_S)
        assert said == ["lead"]
        left = await ttl_of(connection, lease)
        read = time.monotonic()
        # etcd says whole seconds: it ends the lease before `read + left + 1`.
        assert time.monotonic() < leadership.valid_until <= read + left + 1, (
            f"serving for {leadership.valid_until - read:.2f} s on a lease etcd gives {left} s"
        )
    finally:
        await election.close()


async def test_a_scheduler_whose_registration_was_refused_registers_when_it_next_asks(
    etcd_auth_cluster: EtcdCluster,
) -> None:
    etcd = etcd_auth_cluster
    # A user that may write the leader key but not the registrations: the lease is granted
    # (etcd asks no permission for that), the registration put refused.
    user, password = f"{etcd.user}-narrow", secrets.token_hex(12)
    role = f"{user}-role"
    etcd.etcdctl("role", "add", role)
    etcd.etcdctl("role", "grant-permission", role, "readwrite", f"{etcd.prefix}leader")
    etcd.etcdctl("user", "add", f"{user}:{password}", "--interactive=false")
    etcd.etcdctl("user", "grant-role", user, role)
    url = parse_state_url(etcd.state_url())
    connection = EtcdConnection(url, timeout_s=2.0, login=(user, password))
    election = EtcdElection(connection, ADDRESS, LEASE_S)
    try:
        with pytest.raises(EtcdRefused, match="may not read and write"):
            await election.ensure_lease()
        etcd.etcdctl("role", "grant-permission", role, "--prefix=true", "readwrite", etcd.prefix)
        lease = await election.ensure_lease()
        assert [p.address for p in await election.peers()] == [ADDRESS]
        assert await ttl_of(connection, lease) > 0
    finally:
        await election.close()
        await connection.close()


@pytest.mark.parametrize("role", ["leader", "standby"])
async def test_the_election_ends_when_cancelled_as_a_keepalive_is_answered(
    connection: EtcdConnection, role: str
) -> None:
    """A hand-over cancels the election's loop; a cancel that lands in the turn etcd answers
    a keepalive ends it all the same (asyncio.wait_for before 3.12 returns the answer then)."""
    if role == "standby":  # another scheduler leads: this one follows it
        other = EtcdElection(connection, "127.0.0.2:1", LEASE_S)
        assert await other.campaign() is None
    election = EtcdElection(connection, ADDRESS, LEASE_S)
    leadership = Leadership(float(LEASE_S), time.monotonic)

    async def nothing(*args: object) -> None:
        pass

    leading = Leading(election, leadership, nothing, nothing)
    task = asyncio.create_task(leading.run())
    plain = connection.call
    keepalives: list[str] = []

    async def cancelled_as_answered(request: Any, what: str) -> Any:
        answer = await plain(request, what)
        if what == "refresh the lease" and leadership.role.value == role:
            keepalives.append(what)
            task.cancel()  # in the same turn as the answer
        return answer

    connection.call = cancelled_as_answered  # type: ignore[method-assign]
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, LEASE_S + BOUND_S)
        assert keepalives
    finally:
        connection.call = plain  # type: ignore[method-assign]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await election.close()
        if role == "standby":
            await other.close()


SHORT_LEASE_S = 2


def on_a_short_lease(connection: EtcdConnection) -> tuple[EtcdElection, Leadership]:
    """An election on a lease of SHORT_LEASE_S, and its leadership."""
    election = EtcdElection(connection, ADDRESS, SHORT_LEASE_S)
    return election, Leadership(float(SHORT_LEASE_S), time.monotonic)


async def test_a_takeover_longer_than_the_lease_keeps_the_lease_and_leads(
    connection: EtcdConnection,
) -> None:
    """A new leader's takeover (load the job, save it, remove garbage) may take longer than
    its lease (a large key-value store): its lease is kept alive meanwhile, and it leads."""
    election, leadership = on_a_short_lease(connection)
    took_over = asyncio.Event()
    said: list[str] = []

    async def lead() -> None:
        await asyncio.sleep(SHORT_LEASE_S * 1.5)  # sleep-ok: a takeover longer than the lease
        took_over.set()

    async def step_down(why: str) -> None:
        said.append(why)

    leading = Leading(election, leadership, lead, step_down)
    task = asyncio.create_task(leading.run())
    try:
        await asyncio.wait_for(took_over.wait(), SHORT_LEASE_S * 1.5 + BOUND_S)
        assert said == []
        assert leadership.serving()
        assert leadership.terms == 1
        key = await election.leader()
        assert key is not None
        assert key.revision == election.fence
        assert election.lease_id is not None
        assert await ttl_of(connection, election.lease_id) > 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await election.close()


async def test_a_step_down_during_the_takeover_cancels_it_and_says_how_long_it_ran(
    connection: EtcdConnection,
) -> None:
    """A leader whose lease ends while it takes the job over stops the takeover (nothing it
    would install opens the gate) and says it was taking the job over, and for how long."""
    election, leadership = on_a_short_lease(connection)
    started, cancelled, stepped = asyncio.Event(), asyncio.Event(), asyncio.Event()
    said: list[str] = []

    async def lead() -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # a takeover that has not ended yet
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def step_down(why: str) -> None:
        said.append(why)
        stepped.set()

    leading = Leading(election, leadership, lead, step_down)
    task = asyncio.create_task(leading.run())
    try:
        await asyncio.wait_for(started.wait(), BOUND_S)
        lease = election.lease_id
        assert lease is not None
        await connection.call(lambda c: c.revoke_lease(lease), "revoke the lease")
        await asyncio.wait_for(stepped.wait(), SHORT_LEASE_S + BOUND_S)
        assert cancelled.is_set()
        assert "lease" in said[0]
        assert "this scheduler's takeover of the job ran" in said[0]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await election.close()


async def test_a_leader_keeps_its_lease_while_etcd_does_not_answer_the_list_of_schedulers(
    connection: EtcdConnection,
) -> None:
    """After each keepalive a leader reads the job's schedulers (Status shows them). A read
    etcd never answers (a member that takes requests and answers none) is given up by the next
    keepalive's time: the keepalives go on, and the leader keeps its lease and leads. (The
    loop waited on the read, sent no keepalive, and its lease ended in etcd while it still
    took itself for the leader.)"""
    election, leadership = on_a_short_lease(connection)
    led = asyncio.Event()
    said: list[str] = []

    async def lead() -> None:
        led.set()

    async def step_down(why: str) -> None:
        said.append(why)

    plain = connection.call
    lists: list[str] = []

    async def unanswered_lists(request: Any, what: str) -> Any:
        if what == "list the schedulers":
            lists.append(what)
            await asyncio.Event().wait()  # never answered
        return await plain(request, what)

    leading = Leading(election, leadership, lead, step_down)
    task = asyncio.create_task(leading.run())
    try:
        await asyncio.wait_for(led.wait(), BOUND_S)
        connection.call = unanswered_lists  # type: ignore[method-assign]
        keepalives = 3 * KEEPALIVES_PER_LEASE  # three leases' worth
        deadline = time.monotonic() + 3 * SHORT_LEASE_S + BOUND_S
        while len(lists) < keepalives:
            assert time.monotonic() < deadline, f"{len(lists)} turns in {3 * SHORT_LEASE_S} s"
            assert not task.done()
            await asyncio.sleep(0.05)  # sleep-ok: polls the count of reads, bounded above
        assert said == []
        assert leadership.serving()
        assert election.lease_id is not None
        assert await ttl_of(connection, election.lease_id) > 0
    finally:
        connection.call = plain  # type: ignore[method-assign]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await election.close()
