"""The peer table a node holds, from the TopologyReady events of its stream.

A stream's first topology is the whole table; a later one may be a delta (`delta_from`, see
the protocol), laid here over the table of the generation it names (nothing copied). A delta
from any other generation means this node missed a change: `MissedChange`, and the agent
reconnects, which brings the whole table again. A large whole table arrives compressed
(`peers_zlib`): `inflate` puts it in `peers`. Behind a host's relay it arrives as its digest
(`peers_digest`), and the node asks the relay for it (`PeerTable`, `fetch`): the relay answers
with the table it shares with the host's nodes, which the node maps and reads in place
(`cluster.transport.table_file`: O(1) to form, whatever the job's size), or, where it cannot be
mapped, with the compressed bytes, parsed here. `TABLES` holds the tables this process fetched,
once for all of its nodes (a benchmark runs thousands in one process).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from cluster.protocol.errors import MissedTableChange, SharedTableError
from cluster.protocol.topology import PeerColumns, PeerRow, patched
from cluster.transport import failures, stub
from cluster.transport.shared_answers import SharedAnswers
from cluster.v1 import scheduler_pb2 as pb

log = logging.getLogger(__name__)

MissedChange = MissedTableChange  # what `table_of` and `inflate` raise
MAX_TABLE_BYTES = stub.MAX_TABLE_BYTES
# How long a whole table named by its digest may take to fetch (past it: the node reconnects).
FETCH_S = 30.0


def inflate(ready: pb.TopologyReady) -> None:
    """Put a compressed whole table (`peers_zlib`) in `peers`; MissedChange when it does not
    inflate to a table (the node reconnects for the whole table again)."""
    if not ready.peers_zlib:
        return
    stub.parse_table_into(ready.peers, ready.peers_zlib)
    ready.peers_zlib = b""


class FetchedTables:
    """Whole tables by digest, as this process fetched them: one fetch for every node of the
    process that asks for the same digest at once or later."""

    def __init__(self, kept: int = 2) -> None:
        self._tables: SharedAnswers[bytes, PeerColumns] = SharedAnswers(kept)

    async def get(
        self, digest: bytes, fetch: Callable[[bytes], Awaitable[PeerColumns]]
    ) -> PeerColumns:
        """The table of `digest`, fetched with `fetch` unless held or being fetched already;
        MissedChange when it cannot be had or does not match its digest."""
        return await self._tables.get(digest, lambda: fetch(digest))


TABLES = FetchedTables()


async def ask(
    stub_: Any, signed: Callable[[str, Any], Any], digest: bytes, *, shared: bool = False
) -> pb.PeerTableResponse:
    """The answer of the scheduler (or the host's relay, asked with `shared` for the table it
    shares) for the table of `digest`, asked with `stub_`, the call signed by `signed`;
    MissedChange when it is not answered in FETCH_S."""
    request = pb.PeerTableRequest(digest=digest, shared=shared)
    try:
        answer: pb.PeerTableResponse = await stub_.PeerTable(
            request, timeout=FETCH_S, metadata=signed("PeerTable", request)
        )
    except grpc.aio.AioRpcError as exc:
        why = failures.failure_of(exc).details
        raise MissedChange(f"the peer table was not fetched: {why}") from None
    return answer


async def fetch(
    stub_: Any, signed: Callable[[str, Any], Any], digest: bytes, *, shared: bool
) -> PeerColumns:
    """The whole table of `digest`: with `shared` (behind a relay), the relay's shared table
    mapped where it can be, else its compressed bytes asked for and parsed."""
    if shared:
        from cluster.transport import table_file  # noqa: PLC0415 - large tables behind a relay

        answer = await ask(stub_, signed, digest, shared=True)
        if not answer.shared_path:
            return stub.checked_table(digest, answer.peers_zlib)
        try:
            return table_file.open_shared(answer.shared_path, digest)
        except (OSError, SharedTableError) as exc:
            log.info("the relay's shared peer table cannot be read (%s): fetching it", exc)
    answer = await ask(stub_, signed, digest)
    return stub.checked_table(digest, answer.peers_zlib)


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
