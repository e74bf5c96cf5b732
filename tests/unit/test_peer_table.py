"""The peer table on the wire: a large whole table travels compressed, once per generation, and a
node inflates it (bounded); a small one and a delta travel as they are."""

from __future__ import annotations

import asyncio
import hashlib
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.protocol import records as state
from cluster.protocol.records import NodeRole
from cluster.protocol.topology import PeerColumns
from cluster.scheduler import convert
from cluster.scheduler.tables import Tables
from cluster.transport import stub
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import peer_table


def peers(n: int, per_host: int = 8) -> tuple[state.PeerInfo, ...]:
    return tuple(
        state.PeerInfo(
            rank=r,
            node_id=str(r),
            host=f"10.0.{r // per_host // 256}.{r // per_host % 256}",
            port=29500 + r % per_host,
            role=NodeRole.WORKER,
            local_rank=r % per_host,
            local_size=per_host,
        )
        for r in range(n)
    )


def ready_event(n: int) -> pb.TopologyReady:
    event = state.TopologyReadyEvent(generation=1, peers=peers(n), rollback_step=0, reason="x")
    # What a node receives: the message as the scheduler serialized it.
    return pb.Event.FromString(convert.event_to_pb(event).SerializeToString()).topology_ready


def test_a_large_table_travels_compressed_and_inflates_to_the_same_table() -> None:
    ready = ready_event(8192)
    assert not ready.peers.ranks  # the table is in peers_zlib only
    table = convert.peer_table(peers(8192))
    assert len(ready.peers_zlib) * 4 < table.ByteSize()  # 200 KB of table, in under a quarter
    peer_table.inflate(ready)
    assert ready.peers == table
    assert not ready.peers_zlib


def test_a_small_table_and_a_delta_travel_as_they_are() -> None:
    small = ready_event(16)
    assert (len(small.peers.ranks), small.peers_zlib) == (16, b"")
    event = state.TopologyReadyEvent(generation=2, peers=peers(8192), rollback_step=0, reason="")
    delta = convert.topology_delta_to_pb(event, 1, [5]).topology_ready
    assert (list(delta.peers.ranks), delta.peers_zlib) == ([5], b"")
    peer_table.inflate(small)  # nothing to inflate: unchanged
    assert len(small.peers.ranks) == 16


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 600))
def test_every_table_reaches_the_node_whole(n: int) -> None:
    ready = ready_event(n)
    peer_table.inflate(ready)
    assert ready.peers == convert.peer_table(peers(n))


@pytest.mark.parametrize(
    ("blob", "said"),
    [
        (b"not zlib at all", "damaged"),
        (zlib.compress(b"\xff" * 64), "damaged"),  # inflates, but is no PeerTable
        (zlib.compress(b"\x00" * 1000)[:-6], "does not inflate whole"),  # cut short
        (zlib.compress(b"\x00" * (peer_table.MAX_TABLE_BYTES + 1)), "does not inflate whole"),
    ],
    ids=["garbage", "not-a-table", "truncated", "bomb"],
)
def test_a_table_that_does_not_inflate_makes_the_node_ask_again(blob: bytes, said: str) -> None:
    ready = pb.TopologyReady(generation=1, peers_zlib=blob)
    with pytest.raises(peer_table.MissedChange, match=said):
        peer_table.inflate(ready)


def test_a_topology_has_a_digest_form_naming_its_compressed_table() -> None:
    event = state.TopologyReadyEvent(generation=3, peers=peers(400), rollback_step=7, reason="x")
    inline, referenced = convert.topology_forms(convert.event_to_pb(event))
    assert referenced is not None
    by_digest, digest, table = referenced
    ready = pb.Event.FromString(by_digest).topology_ready
    assert (ready.generation, ready.rollback_step, ready.peers_zlib) == (3, 7, b"")
    assert ready.peers_digest == digest == hashlib.sha256(table).digest()
    assert pb.Event.FromString(inline).topology_ready.peers_zlib == table
    small = state.TopologyReadyEvent(generation=1, peers=peers(4), rollback_step=0, reason="x")
    assert convert.topology_forms(convert.event_to_pb(small))[1] is None  # nothing to fetch


def test_the_scheduler_keeps_the_last_tables_and_refuses_an_older_one() -> None:
    tables = Tables(kept=2)
    forms = []
    for generation in (1, 2, 3):
        event = state.TopologyReadyEvent(
            generation=generation, peers=peers(300 + generation), rollback_step=0, reason="x"
        )
        inline, referenced = convert.topology_forms(convert.event_to_pb(event))
        assert referenced is not None
        tables.keep(inline, *referenced)
        forms.append((inline, referenced))
    inline, (by_digest, digest, table) = forms[-1]
    assert tables.by_digest(inline) is by_digest
    copy = inline[:1] + inline[1:]
    assert tables.by_digest(copy) is copy  # an equal copy is not the told object
    assert tables.table(digest) == table
    with pytest.raises(peer_table.MissedChange, match="holds no peer table"):
        tables.table(forms[0][1][1])


async def test_a_process_fetches_a_table_once_and_checks_it() -> None:
    event = state.TopologyReadyEvent(generation=1, peers=peers(300), rollback_step=0, reason="x")
    _, referenced = convert.topology_forms(convert.event_to_pb(event))
    assert referenced is not None
    _, digest, table = referenced
    asked: list[bytes] = []
    gate = asyncio.Event()

    async def ask(wanted: bytes) -> PeerColumns:
        asked.append(wanted)
        await gate.wait()
        return stub.checked_table(wanted, table)

    fetched = peer_table.FetchedTables()
    waiting = [asyncio.ensure_future(fetched.get(digest, ask)) for _ in range(5)]
    await asyncio.sleep(0)  # sleep-ok: one turn of the loop, so that each asks; not a wait
    gate.set()
    got = await asyncio.gather(*waiting)
    assert asked == [digest]
    assert all(t is got[0] for t in got)
    assert len(got[0].node_ids) == 300

    async def wrong(wanted: bytes) -> PeerColumns:
        return stub.checked_table(wanted, zlib.compress(b"not the table"))

    with pytest.raises(peer_table.MissedChange, match="does not match"):
        await peer_table.FetchedTables().get(digest, wrong)


async def test_a_failed_fetch_leaves_nothing_behind() -> None:
    event = state.TopologyReadyEvent(generation=1, peers=peers(300), rollback_step=0, reason="x")
    _, referenced = convert.topology_forms(convert.event_to_pb(event))
    assert referenced is not None
    _, digest, table = referenced
    answers = [peer_table.MissedChange("the peer table was not fetched: gone"), table]

    async def ask(wanted: bytes) -> PeerColumns:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return stub.checked_table(wanted, answer)

    fetched = peer_table.FetchedTables()
    with pytest.raises(peer_table.MissedChange, match="not fetched"):
        await fetched.get(digest, ask)
    assert len((await fetched.get(digest, ask)).node_ids) == 300  # asked again, not the failure
