"""cluster.scheduler.core: what the scheduler does with collectives across generations."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable

import pytest

from cluster.protocol.errors import CollectiveError, NotLeaderError, PeerFailedError
from cluster.protocol.settings import JobSettings
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.engine import PROGRESS_BROADCAST_EVERY_S, PROGRESS_REPEAT_EVERY_S
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import peer_table
from tests.aio import BOUND_S, settle
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


async def test_a_call_made_again_after_a_peer_finished_gets_its_answer() -> None:
    """Both ranks were answered the last collective; rank 1's answer was lost with its
    connection, and rank 0 finished meanwhile. Rank 1's call made again gets the answer it was
    given (it was refused as a rank that had not taken part); a new collective is refused at
    once, since the finished rank will never call it."""
    clock = FakeClock(100.0)
    core = SchedulerCore(SETTINGS, clock)
    for node_id in ("0", "1"):
        await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)

    def allgather(node_id: str, seq: int) -> Awaitable[list[bytes]]:
        return asyncio.wait_for(
            core.exchange(
                node_id,
                caller(node_id, 1),
                generation=1,
                seq=seq,
                op="allgather",
                root=0,
                value=node_id.encode(),
            ),
            BOUND_S,
        )

    assert await asyncio.gather(allgather("0", 5), allgather("1", 5)) == [[b"0", b"1"]] * 2
    await asyncio.wait_for(core.finish("0", 1, caller("0", 1)), BOUND_S)
    assert await allgather("1", 5) == [b"0", b"1"]
    with pytest.raises(CollectiveError, match=r"rank 0 .* has already finished"):
        await allgather("1", 6)


async def _next_event(stream: AsyncIterator[pb.Event | bytes]) -> pb.Event:
    item = await asyncio.wait_for(anext(stream), BOUND_S)
    return item if isinstance(item, pb.Event) else pb.Event.FromString(item)


async def test_a_rejoin_reaches_open_streams_as_a_delta_and_a_new_stream_as_the_table() -> None:
    """After a rejoin only the rejoined node's row travels to the nodes that hold the table; a
    stream opened later (a node that reconnected, so may have missed that change) gets the
    whole table, and the delta applied to the old table is that whole table."""
    clock = FakeClock()
    core = SchedulerCore(SETTINGS, clock)
    for node_id in ("0", "1"):
        await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
    stream = core.watch("0", 1)
    first = (await _next_event(stream)).topology_ready
    assert (first.generation, first.delta_from, list(first.peers.ports)) == (1, 0, [6000, 6000])
    core._apply(core.state.disconnect("1", 1))
    clock.now += 6.0
    moved = dataclasses.replace(registration("1", incarnation=2), port=7001)
    await asyncio.wait_for(core.register(moved), BOUND_S)
    assert (await _next_event(stream)).WhichOneof("kind") == "node_failed"
    delta = (await _next_event(stream)).topology_ready
    assert (delta.generation, delta.delta_from, list(delta.changed_rows)) == (2, 1, [1])
    assert (list(delta.peers.node_ids), list(delta.peers.ports)) == (["1"], [7001])
    whole = (await _next_event(core.watch("1", 2))).topology_ready
    assert (whole.generation, whole.delta_from, list(whole.peers.ports)) == (2, 0, [6000, 7001])
    applied = peer_table.table_of(delta, (1, first.peers))
    for column in ("ranks", "node_ids", "hosts", "ports", "local_ranks", "local_sizes"):
        assert list(getattr(applied, column)) == list(getattr(whole.peers, column)), column
    with pytest.raises(peer_table.MissedChange, match="from generation 1 to 2"):
        peer_table.table_of(delta, (2, whole.peers))
    with pytest.raises(peer_table.MissedChange, match="holds no table"):
        peer_table.table_of(delta, None)


async def test_a_node_waiting_out_its_guard_is_journaled_once_not_once_a_second() -> None:
    clock = FakeClock(100.0)
    core = SchedulerCore(SETTINGS, clock)
    for node_id in ("0", "1"):
        await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
    core._apply(core.state.disconnect("1", 1))
    for _ in range(4):  # the restarted process asks every second within the 5 s guard
        await asyncio.wait_for(core.register(registration("1", incarnation=2)), BOUND_S)
        clock.now += 1.0
    clock.now += 2.0
    await asyncio.wait_for(core.register(registration("1", incarnation=2)), BOUND_S)
    kinds = [event.kind for event in core.journal.history()]
    assert kinds.count("guard_refusal") == 1, kinds
    assert kinds.count("rejoined") == 1, kinds


async def test_a_stream_opened_after_the_job_ended_ends_after_its_shutdown() -> None:
    """The catch-up of a stream opened once the job is over is the Shutdown, its last event:
    the stream ends there, as a stream open at the end does."""
    core = SchedulerCore(dataclasses.replace(SETTINGS, recovery=False))
    for node_id in ("0", "1"):
        await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
    core.abort("scheduler stopped by SIGINT")
    stream = core.watch("0", 1, caller("0", 1))
    assert (await _next_event(stream)).WhichOneof("kind") == "shutdown"
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(stream), BOUND_S)
    assert core.open_streams == 0


async def test_a_step_down_tells_the_collectives_waiting_where_the_leader_is() -> None:
    core = SchedulerCore(SETTINGS)
    for node_id in ("0", "1"):
        await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
    gather = asyncio.ensure_future(
        core.exchange("1", caller("1", 1), generation=1, seq=1, op="allgather", root=0, value=b"")
    )
    await settle(lambda: len(core.exchanges) == 1)
    core.stand_down(NotLeaderError("this scheduler stands by", leader="10.0.0.9:8118"))
    with pytest.raises(NotLeaderError) as refused:
        await asyncio.wait_for(gather, BOUND_S)
    assert refused.value.leader == "10.0.0.9:8118"


async def test_a_waiting_job_tells_its_count_again_while_a_node_is_missing() -> None:
    """A worker says how long it has waited only when told the count, and only once it has
    waited a while itself: one told the count sooner (the single broadcast of a registration)
    heard nothing more while the other node was missing, and said nothing (a CI run waited 30 s
    for its line). The count is told again every PROGRESS_REPEAT_EVERY_S while the job waits,
    and no longer once it has formed."""
    clock = FakeClock(100.0)
    core = SchedulerCore(dataclasses.replace(SETTINGS, recovery=False), clock)
    await asyncio.wait_for(core.register(registration("0")), BOUND_S)
    stream = core.watch("0", 1, caller("0", 1))
    first = asyncio.ensure_future(_next_event(stream))
    await settle(lambda: core.open_streams == 1)
    clock.now += PROGRESS_BROADCAST_EVERY_S
    core._flush_progress()
    told = (await first).progress
    assert (told.registered, told.expected) == (1, 2)
    for _ in range(2):
        core._flush_progress()  # within the interval: nothing
        clock.now += PROGRESS_REPEAT_EVERY_S
        core._flush_progress()
        again = (await _next_event(stream)).progress
        assert (again.registered, again.expected) == (1, 2)
    await asyncio.wait_for(core.register(registration("1")), BOUND_S)
    assert (await _next_event(stream)).WhichOneof("kind") == "topology_ready"
    clock.now += PROGRESS_REPEAT_EVERY_S
    core._flush_progress()
    core.abort("scheduler stopped by SIGINT")
    assert (await _next_event(stream)).WhichOneof("kind") == "shutdown"


async def test_a_process_that_takes_a_silent_nodes_id_is_journaled_after_its_failure() -> None:
    """Node '1' silent past its guard, not yet failed (the silence limit is 3 heartbeat
    intervals): a new process of its id fails it (cause `replaced`) and rejoins. The journal
    said `rejoined`, then `failed`: every reader (mscluster events, the chaos timeline) ended
    with a live rank shown failed."""
    settings = dataclasses.replace(SETTINGS, node_timeout_s=1.0, heartbeat_interval_s=1.0)
    clock = FakeClock(100.0)
    core = SchedulerCore(settings, clock)
    for node_id in ("0", "1"):
        await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
    clock.now += 1.5  # past the guard (1 s), not past the silence limit (3 s)
    await asyncio.wait_for(core.register(registration("1", incarnation=2)), BOUND_S)
    told = [e for e in core.journal.history() if e.kind in ("failed", "rejoined", "generation")]
    assert [e.kind for e in told] == ["failed", "rejoined", "generation"], told
    assert told[0].fields["cause"] == "replaced"
