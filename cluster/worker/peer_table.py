"""The peer table a node holds, from the TopologyReady events of its stream.

A stream's first topology is the whole table; a later one may be a delta (`delta_from`, see
the protocol), applied here to the table of the generation it names. A delta from any other
generation means this node missed a change: `MissedChange`, and the agent reconnects, which
brings the whole table again. A large whole table arrives compressed (`peers_zlib`): `inflate`
puts it in `peers`.
"""

from __future__ import annotations

import zlib

from google.protobuf.message import DecodeError

from cluster.protocol.errors import MissedTableChange
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


def table_of(ready: pb.TopologyReady, held: tuple[int, pb.PeerTable] | None) -> pb.PeerTable:
    """The whole peer table of `ready`, given `held` (generation, table) as this node has it."""
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
    table = pb.PeerTable()
    table.CopyFrom(held[1])
    size = len(table.node_ids)
    for column in _COLUMNS:
        if len(getattr(delta, column)) != len(rows):
            raise MissedChange(f"a change of the peer table with a malformed column {column}")
    for k, row in enumerate(rows):
        if row >= size:
            raise MissedChange(f"a change of the peer table names row {row} of {size}")
        for column in _COLUMNS:
            getattr(table, column)[row] = getattr(delta, column)[k]
    return table
