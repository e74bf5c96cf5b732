"""The peer table a node holds, from the TopologyReady events of its stream.

A stream's first topology is the whole table; a later one may be a delta (`delta_from`, see
the protocol), laid here over the table of the generation it names (nothing copied). A delta
from any other generation means this node missed a change: `MissedChange`, and the agent
reconnects, which brings the whole table again. A large whole table arrives compressed
(`peers_zlib`): `inflate` puts it in `peers`. Behind a host's relay it arrives as its digest
(`peers_digest`), and the node asks for it (`PeerTable`): `TABLES` holds the tables this
process fetched, parsed once for all of its nodes (a benchmark runs thousands in one process).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from cluster.protocol.errors import MissedTableChange
from cluster.protocol.topology import PeerColumns, PeerRow, patched
from cluster.transport import failures
from cluster.transport.shared_answers import SharedAnswers
from cluster.v1 import scheduler_pb2 as pb

MissedChange = MissedTableChange  # what `table_of` and `inflate` raise

# A compressed table inflates to at most this (a gRPC message's limit here: 2.6 million nodes
# at 24 bytes each); more is refused, not allocated.
MAX_TABLE_BYTES = 64 * 1024 * 1024
# How long a whole table named by its digest may take to fetch (past it: the node reconnects).
FETCH_S = 30.0


def inflate(ready: pb.TopologyReady) -> None:
    """Put a compressed whole table (`peers_zlib`) in `peers`; MissedChange when it does not
    inflate to a table (the node reconnects for the whole table again)."""
    if not ready.peers_zlib:
        return
    _parse_into(ready.peers, ready.peers_zlib)
    ready.peers_zlib = b""


def _parse_into(table: pb.PeerTable, compressed: bytes) -> None:
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(compressed, MAX_TABLE_BYTES)
        if inflater.unconsumed_tail or not inflater.eof:
            raise MissedChange(
                f"the scheduler sent a compressed peer table that does not inflate whole within "
                f"{MAX_TABLE_BYTES} bytes"
            )
        table.ParseFromString(data)
    except (zlib.error, DecodeError) as exc:
        raise MissedChange(
            f"the scheduler sent a compressed peer table that is damaged ({exc})"
        ) from None


class FetchedTables:
    """Whole tables by digest, as this process fetched and parsed them: one fetch and one parse
    for every node of the process that asks for the same digest at once or later."""

    def __init__(self, kept: int = 2) -> None:
        self._tables: SharedAnswers[bytes, pb.PeerTable] = SharedAnswers(kept)

    async def get(self, digest: bytes, ask: Callable[[bytes], Awaitable[bytes]]) -> pb.PeerTable:
        """The table of `digest`, asked for with `ask` (its compressed bytes) unless held or
        asked for already; MissedChange when it cannot be had or does not match its digest."""

        async def fetch() -> pb.PeerTable:
            return _checked(digest, await ask(digest))

        return await self._tables.get(digest, fetch)


def _checked(digest: bytes, compressed: bytes) -> pb.PeerTable:
    if hashlib.sha256(compressed).digest() != digest:
        raise MissedChange(f"the peer table fetched for {digest.hex()[:16]} does not match it")
    table = pb.PeerTable()
    _parse_into(table, compressed)
    return table


TABLES = FetchedTables()


async def ask(stub: Any, signed: Callable[[str, Any], Any], digest: bytes) -> bytes:
    """The compressed table of `digest`, asked of the scheduler (or the host's relay) with
    `stub`, the call signed by `signed`; MissedChange when it is not answered in FETCH_S."""
    request = pb.PeerTableRequest(digest=digest)
    try:
        answer = await stub.PeerTable(
            request, timeout=FETCH_S, metadata=signed("PeerTable", request)
        )
    except grpc.aio.AioRpcError as exc:
        why = failures.failure_of(exc).details
        raise MissedChange(f"the peer table was not fetched: {why}") from None
    return bytes(answer.peers_zlib)


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

    def take(self, ready: pb.TopologyReady, fetched: PeerColumns | None = None) -> PeerColumns:
        """The whole table of `ready` (inflated, a delta laid over the held table, or the
        table `fetched` by its digest), now held; MissedChange when it does not inflate or this
        node does not hold the delta's base."""
        if fetched is not None:
            table = fetched
        elif ready.peers_digest:
            raise MissedChange("the scheduler named a peer table by digest that was not fetched")
        else:
            inflate(ready)
            table = table_of(ready, self.last)
        self.last = (ready.generation, table)
        return table
