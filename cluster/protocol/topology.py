"""What a worker knows of the job once it has formed. Plain data, no grpc."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import field
from typing import Protocol

from cluster.protocol.value import frozen


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
    def node_ids(self) -> Sequence[str]: ...

    @property
    def hosts(self) -> Sequence[str]: ...

    @property
    def ports(self) -> Sequence[int]: ...


@frozen
class Topology:
    """This process's view of the job at one generation.

    The peer table stays in the columns it arrived in, and `node_ids`, `hosts`, `ports` and
    `peers` become Python objects on first use: a worker of a large job that never asks for
    them never pays for them (3 x 1024 strings and ints per worker in a 1024-node job).
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
        return tuple(
            Peer(rank, node_id, host, port)
            for rank, (node_id, host, port) in enumerate(
                zip(self.node_ids, self.hosts, self.ports, strict=True)
            )
        )


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
