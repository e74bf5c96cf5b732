"""What a worker knows of the job once it has formed. Plain data, no grpc.

The peer table stays in the columns it arrived in (the protobuf message, `PeerColumns`): a
worker finds its own row, and any one peer, in O(1) or O(log N) (`find_row`, `Topology.peer`),
and builds Python objects for the whole table only when it asks for all of it
(`Topology.peers`). A change of the table (a delta, after a rejoin) lies over the table it
changes (`PatchedColumns`) instead of copying it: O(changed rows) per node, not O(N).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import field
from typing import Protocol, TypeVar, overload

from cluster.protocol.value import frozen

T = TypeVar("T")


@frozen
class Peer:
    """One worker of the job, as every other worker sees it."""

    rank: int
    node_id: str
    host: str
    port: int


class PeerColumns(Protocol):
    """The peer table as it arrived (the protobuf message): columns in rank order, workers
    first, then servers."""

    @property
    def ranks(self) -> Sequence[int]: ...

    @property
    def node_ids(self) -> Sequence[str]: ...

    @property
    def hosts(self) -> Sequence[str]: ...

    @property
    def ports(self) -> Sequence[int]: ...

    @property
    def local_ranks(self) -> Sequence[int]: ...

    @property
    def local_sizes(self) -> Sequence[int]: ...


@frozen
class PeerRow:
    """One row of the peer table, as a delta carries it."""

    rank: int
    node_id: str
    host: str
    port: int
    local_rank: int
    local_size: int


@frozen
class Topology:
    """This process's view of the job at one generation.

    `peer(rank)` reads one row of the columns; `node_ids`, `hosts`, `ports` and `peers` become
    Python objects on first use: a worker of a large job that never asks for them never pays
    for them (3 x 65,536 strings and ints per worker in a 65,536-node job).
    """

    generation: int
    rank: int
    local_rank: int
    local_size: int
    size: int  # the number of workers
    table: PeerColumns = field(repr=False, compare=False)
    # Where training (re)starts in this generation: the newest checkpoint step every worker holds.
    rollback_step: int = 0
    reason: str = "formed"

    def peer(self, rank: int) -> Peer:
        """The worker of `rank`, read from its row alone; IndexError outside 0..size-1."""
        if not 0 <= rank < self.size:
            raise IndexError(f"rank {rank} is not a worker's rank (0 to {self.size - 1})")
        table = self.table
        return Peer(rank, table.node_ids[rank], table.hosts[rank], table.ports[rank])

    @functools.cached_property
    def node_ids(self) -> tuple[str, ...]:
        """The workers' node ids, in rank order."""
        return tuple(self.table.node_ids[: self.size])

    @functools.cached_property
    def hosts(self) -> tuple[str, ...]:
        return tuple(self.table.hosts[: self.size])

    @functools.cached_property
    def ports(self) -> tuple[int, ...]:
        return tuple(self.table.ports[: self.size])

    @functools.cached_property
    def peers(self) -> tuple[Peer, ...]:
        """Every worker, in rank order: the whole table as objects, built on first use."""
        return tuple(
            Peer(rank, node_id, host, port)
            for rank, (node_id, host, port) in enumerate(
                zip(self.node_ids, self.hosts, self.ports, strict=True)
            )
        )


def find_row(
    table: PeerColumns, node_id: str, host: str, rows: range, guesses: Sequence[int] = ()
) -> int | None:
    """The row of `node_id` (registered from `host`) in `table`; None: not there.

    O(1) for a row among `guesses` (a numeric id's rank, the row of the last table); O(log N)
    when `rows` (the rows of its role) are in the order the scheduler gives ranks, by (host,
    node id); a table in any other order (ids numeric and not, a spare promoted, a rejoin from
    another host) is scanned. Node ids are unique in a table, so a row whose id matches is the
    row, however it was found.
    """
    ids = table.node_ids
    size = len(ids)
    for row in guesses:
        if 0 <= row < size and ids[row] == node_id:
            return row
    import bisect  # noqa: PLC0415 - most lookups end above; a fraction of a ms of every start

    rows = range(max(rows.start, 0), min(rows.stop, size))
    hosts = table.hosts
    at = bisect.bisect_left(rows, (host, node_id), key=lambda r: (hosts[r], ids[r]))
    if at < len(rows) and ids[rows[at]] == node_id:
        return rows[at]
    try:
        return list(ids).index(node_id)
    except ValueError:
        return None


class PatchedColumn(Sequence[T]):
    """One column of a table with some rows replaced: O(1) per read, nothing copied."""

    def __init__(self, base: Sequence[T], patch: Mapping[int, T]) -> None:
        self._base = base
        self._patch = patch

    def __len__(self) -> int:
        return len(self._base)

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return [self[row] for row in range(*index.indices(len(self)))]
        row = index + len(self) if index < 0 else index
        if not 0 <= row < len(self):
            raise IndexError(f"row {index} of a table of {len(self)}")
        return self._patch[row] if row in self._patch else self._base[row]

    def __iter__(self) -> Iterator[T]:
        return (self[row] for row in range(len(self)))


class PatchedColumns:
    """A whole table (`base`) with the rows of later deltas laid over it (`rows`): what a
    node holds after a rejoin, without copying the N rows it did not change."""

    def __init__(self, base: PeerColumns, rows: Mapping[int, PeerRow]) -> None:
        self.base = base
        self.rows = dict(rows)
        self.ranks = PatchedColumn(base.ranks, {r: p.rank for r, p in self.rows.items()})
        self.node_ids = PatchedColumn(base.node_ids, {r: p.node_id for r, p in self.rows.items()})
        self.hosts = PatchedColumn(base.hosts, {r: p.host for r, p in self.rows.items()})
        self.ports = PatchedColumn(base.ports, {r: p.port for r, p in self.rows.items()})
        self.local_ranks = PatchedColumn(
            base.local_ranks, {r: p.local_rank for r, p in self.rows.items()}
        )
        self.local_sizes = PatchedColumn(
            base.local_sizes, {r: p.local_size for r, p in self.rows.items()}
        )


def patched(table: PeerColumns, rows: Mapping[int, PeerRow]) -> PatchedColumns:
    """`table` with `rows` replaced; the rows of an earlier patch are carried over, so a read
    never goes through more than one patch (O(rows changed since the whole table))."""
    if isinstance(table, PatchedColumns):
        return PatchedColumns(table.base, {**table.rows, **rows})
    return PatchedColumns(table, rows)


def changed_rows(old: Sequence[object], new: Sequence[object]) -> list[int] | None:
    """The rows of peer table `new` that differ from `old` (in order), or None when a delta
    would not be smaller than the whole table: another size, or every row changed.

    After a rejoin only the rejoined node's row can change (its address), so a new generation
    travels to the nodes that held the old one as a delta of one row, or of none.
    """
    if len(old) != len(new):
        return None
    rows = [row for row, (was, now) in enumerate(zip(old, new, strict=True)) if was != now]
    return rows if len(rows) < len(new) else None
