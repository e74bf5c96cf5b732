"""A worker reads the peer table it holds row by row: its own row and any one peer in O(1) or
O(log N), the whole table only when it asks for it, and a delta laid over the table it changes
(nothing copied). Every lookup agrees with the whole table built the old way."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.protocol import records as state
from cluster.protocol.config import ClusterConfig
from cluster.protocol.environment import from_env
from cluster.protocol.records import NodeRole
from cluster.protocol.topology import PeerColumns, Topology, find_row
from cluster.scheduler import convert
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import convert as worker_convert
from cluster.worker import peer_table
from cluster.worker.machine import steps

COLUMNS = ("ranks", "node_ids", "hosts", "ports", "local_ranks", "local_sizes")


def table_of(rows: Sequence[tuple[str, str, int]], per_host: int = 4) -> pb.PeerTable:
    """A table of workers (node id, host, port) in the given order, ranked by position."""
    return convert.peer_table(
        tuple(
            state.PeerInfo(r, node_id, host, port, NodeRole.WORKER, r % per_host, per_host)
            for r, (node_id, host, port) in enumerate(rows)
        )
    )


def ranked(n: int, numeric: bool = False) -> list[tuple[str, str, int]]:
    """n workers in the scheduler's order: by (host, node id), 8 to a host."""
    rows = [
        (str(i) if numeric else f"w{i:05d}", f"10.0.{i // 8 // 256}.{i // 8 % 256}", i)
        for i in range(n)
    ]
    return sorted(rows, key=lambda row: (row[1], row[0]))


class Counted:
    """A table whose reads are counted, row by row."""

    def __init__(self, table: PeerColumns) -> None:
        self.reads = 0
        self.ranks: Sequence[int] = _CountedColumn(self, table.ranks)
        self.node_ids: Sequence[str] = _CountedColumn(self, table.node_ids)
        self.hosts: Sequence[str] = _CountedColumn(self, table.hosts)
        self.ports: Sequence[int] = _CountedColumn(self, table.ports)
        self.local_ranks: Sequence[int] = _CountedColumn(self, table.local_ranks)
        self.local_sizes: Sequence[int] = _CountedColumn(self, table.local_sizes)


class _CountedColumn(Sequence[Any]):
    def __init__(self, owner: Counted, column: Sequence[Any]) -> None:
        self.owner, self.column = owner, column

    def __len__(self) -> int:
        return len(self.column)

    def __getitem__(self, index: Any) -> Any:
        got = self.column[index]
        self.owner.reads += len(got) if isinstance(index, slice) else 1
        return got


def config(n: int, node_id: str) -> ClusterConfig:
    env = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": str(n), "MS_SCHED_HOST": "127.0.0.1"}
    return from_env({**env, "MS_SCHED_PORT": "8118", "MS_NODE_ID": node_id})


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(1, 80), st.booleans(), st.booleans())
def test_every_row_is_found_as_a_scan_finds_it(
    data: st.DataObject, n: int, shuffled: bool, numeric: bool
) -> None:
    rows = ranked(n, numeric)
    if shuffled:  # a spare promoted, a rejoin from another host: not in (host, id) order
        rows = data.draw(st.permutations(rows))
    table = table_of(rows)
    ids = list(table.node_ids)
    for node_id, host, _ in rows:
        guesses = data.draw(st.lists(st.integers(-2, n + 2), max_size=2))
        assert find_row(table, node_id, host, range(n), guesses) == ids.index(node_id)
    assert find_row(table, "absent", "10.0.0.0", range(n)) is None


def test_a_worker_finds_its_row_in_a_65536_table_in_log_n_reads() -> None:
    n = 65536
    table = Counted(table_of(ranked(n)))
    for node_id, host, _ in ranked(n)[:: n // 64]:
        table.reads = 0
        assert find_row(table, node_id, host, range(n)) is not None
        assert table.reads <= 2 * math.ceil(math.log2(n)) + 4  # each step reads host and id


def test_forming_reads_a_few_rows_of_the_table_not_all() -> None:
    """What a worker does when the table arrives (its own row, its view) and what
    cluster.torch asks (rank 0's host) read O(log N) rows; `peers` reads them all."""
    n = 4096
    rows = ranked(n)
    table = Counted(table_of(rows))
    node_id, host, _ = rows[1234]
    ready = pb.TopologyReady(generation=3, reason="formed")
    message = pb.Event(topology_ready=ready)
    event = worker_convert.stream_event(message, config(n, node_id), node_id, table, host=host)
    assert isinstance(event, steps.TopologyReady)
    topology = event.topology
    assert (topology.rank, topology.generation, topology.local_rank) == (1234, 3, 1234 % 4)
    assert topology.peer(0).host == rows[0][1]
    assert table.reads <= 4 * math.ceil(math.log2(n)) + 8
    assert len(topology.peers) == n
    assert table.reads >= 3 * n


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 50))
def test_one_peer_is_the_peer_of_the_whole_table(n: int) -> None:
    table = table_of(ranked(n))
    topology = Topology(1, 0, 0, 1, n, table)
    assert [topology.peer(r) for r in range(n)] == list(topology.peers)
    for outside in (-1, n):
        with pytest.raises(IndexError, match=f"rank {outside} is not"):
            topology.peer(outside)


def whole_applied(held: pb.PeerTable, delta: pb.TopologyReady) -> pb.PeerTable:
    """A delta applied the way it was before: the held table copied, the rows assigned."""
    table = pb.PeerTable()
    table.CopyFrom(held)
    for k, row in enumerate(delta.changed_rows):
        for column in (*COLUMNS, "roles"):
            getattr(table, column)[row] = getattr(delta.peers, column)[k]
    return table


def columns(table: PeerColumns) -> list[list[Any]]:
    return [list(getattr(table, column)) for column in COLUMNS]


moves = st.lists(st.tuples(st.integers(0, 39), st.integers(1, 60000)), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(st.lists(moves, min_size=1, max_size=5))
def test_deltas_laid_over_the_table_read_as_the_table_copied_and_changed(
    generations: list[list[tuple[int, int]]],
) -> None:
    """Rejoins move nodes (their port changes): each generation travels as a delta, and the
    table a node holds after each reads as the whole table; the topology of an older
    generation still reads its own table."""
    n = 40
    infos = [7000 + r for r in range(n)]
    whole = convert.peer_table(tuple(peer(r, port) for r, port in enumerate(infos)))
    held = peer_table.HeldTable()
    first = pb.TopologyReady(generation=1, peers=whole)
    older = Topology(1, 0, 0, 1, n, held.take(first))
    expected = whole
    for generation, moved in enumerate(generations, start=2):
        for row, port in moved:
            infos[row] = port
        peers = tuple(peer(r, port) for r, port in enumerate(infos))
        rows = sorted({row for row, _ in moved})
        event = state.TopologyReadyEvent(generation, peers, 0, "rank rejoined")
        delta = convert.topology_delta_to_pb(event, generation - 1, rows).topology_ready
        expected = whole_applied(expected, delta)
        got = held.take(delta)
        assert columns(got) == columns(expected)
        assert columns(got) == columns(convert.peer_table(peers))
    assert older.ports == tuple(7000 + r for r in range(n))


def peer(rank: int, port: int) -> state.PeerInfo:
    return state.PeerInfo(rank, f"w{rank}", "127.0.0.1", port, NodeRole.WORKER, rank, 40)


def test_a_delta_from_another_generation_or_out_of_the_table_is_a_missed_change() -> None:
    held = peer_table.HeldTable()
    held.take(pb.TopologyReady(generation=1, peers=table_of(ranked(4))))
    peers = tuple(peer(r, 9000) for r in range(4))
    event = state.TopologyReadyEvent(3, peers, 0, "x")
    with pytest.raises(peer_table.MissedChange, match="from generation 2 to 3"):
        held.take(convert.topology_delta_to_pb(event, 2, [1]).topology_ready)
    beyond = convert.topology_delta_to_pb(event, 1, [1]).topology_ready
    beyond.changed_rows[0] = 9
    with pytest.raises(peer_table.MissedChange, match="names row 9 of 4"):
        held.take(beyond)
