"""The peer table a node holds, from the TopologyReady events of its stream.

A stream's first topology is the whole table; a later one may be a delta (`delta_from`, see
the protocol), laid here over the table of the generation it names (nothing copied). A delta
from any other generation means this node missed a change: `MissedChange`, and the agent
reconnects, which brings the whole table again. A large whole table arrives compressed
(`peers_zlib`): `inflate` puts it in `peers`.
"""

from __future__ import annotations

import zlib

from google.protobuf.message import DecodeError

from cluster.protocol.errors import MissedTableChange
from cluster.protocol.topology import PeerColumns, PeerRow, patched
from cluster.v1 import scheduler_pb2 as pb

MissedChange = MissedTableChange  # what `table_of` and `inflate` raise

# A compressed table inflates to at most this (a gRPC message's limit here: 2.6 million nodes
# at 24 bytes each); more is refused, not allocated.
MAX_TABLE_BYTES = 64 * 1024 * 1024


def inflate(ready: pb.TopologyReady) -> None:
    """Put a compressed whole table (`peers_zlib`) in `peers`; MissedChange when it does not
    inflate to a table (the node reconnects for the whole table again)."""
    if not ready.peers_zlib:
        return
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(ready.peers_zlib, MAX_TABLE_BYTES)
        if inflater.unconsumed_tail or not inflater.eof:
            raise MissedChange(
                f"the scheduler sent a compressed peer table that does not inflate whole within "
                f"{MAX_TABLE_BYTES} bytes"
            )
        ready.peers.ParseFromString(data)
    except (zlib.error, DecodeError) as exc:
        raise MissedChange(
            f"the scheduler sent a compressed peer table that is damaged ({exc})"
        ) from None
    ready.peers_zlib = b""


_COLUMNS = ("ranks", "node_ids", "hosts", "ports", "roles", "local_ranks", "local_sizes")


def table_of(ready: pb.TopologyReady, held: tuple[int, PeerColumns] | None) -> PeerColumns:
    """The whole peer table of `ready`, given `held` (generation, table) as this node has it.

    A delta lies over the held table (`topology.patched`): O(changed rows), the N rows it did
    not change neither copied nor read; the held table is left as it is (the topology of the
    last generation still reads it)."""
    if not ready.delta_from:
        return ready.peers
    if held is None or held[0] != ready.delta_from:
        have = "no table" if held is None else f"the table of generation {held[0]}"
        raise MissedChange(
            f"the scheduler sent the change of the peer table from generation "
            f"{ready.delta_from} to {ready.generation}, and this node holds {have}"
        )
    delta = ready.peers
    rows = list(ready.changed_rows)
    size = len(held[1].node_ids)
    for column in _COLUMNS:
        if len(getattr(delta, column)) != len(rows):
            raise MissedChange(f"a change of the peer table with a malformed column {column}")
    changed: dict[int, PeerRow] = {}
    for k, row in enumerate(rows):
        if row >= size:
            raise MissedChange(f"a change of the peer table names row {row} of {size}")
        changed[row] = PeerRow(
            delta.ranks[k],
            delta.node_ids[k],
            delta.hosts[k],
            delta.ports[k],
            delta.local_ranks[k],
            delta.local_sizes[k],
        )
    return patched(held[1], changed)


class HeldTable:
    """The last whole peer table this node heard: the base of the next delta. A spare holds no
    topology, but hears (and holds) every table."""

    def __init__(self) -> None:
        self.last: tuple[int, PeerColumns] | None = None

    def take(self, ready: pb.TopologyReady) -> PeerColumns:
        """The whole table of `ready` (inflated, a delta laid over the held table), now held;
        MissedChange when it does not inflate or this node does not hold the delta's base."""
        inflate(ready)
        table = table_of(ready, self.last)
        self.last = (ready.generation, table)
        return table
