"""Whole peer tables by digest: what a node behind its host's relay is sent instead of the table.

A large job's whole table travels compressed (`TopologyReady.peers_zlib`), the same bytes to
every node. A node that says so in its Watch request (`table_by_digest`: one behind a relay) is
sent the table's SHA-256 instead (`peers_digest`), and asks for the bytes with `PeerTable`; the
host's relay asks the scheduler once for all of its nodes (`cluster.transport.relay`). So a
formation sends the table once per host, not once per node: at 65,536 workers that is 64
tables, not 65,536 (18 GiB).

The scheduler keeps the tables of its last `KEPT` topologies: a node that asks for an older one
is told it missed a change, and reconnects for the newest.
"""

from __future__ import annotations

import collections

from cluster.protocol import topology
from cluster.protocol.errors import MissedTableChange
from cluster.scheduler import convert
from cluster.scheduler.machine import state

KEPT = 4


class Tables:
    """The serialized whole topologies told lately, each in its two forms (the table in it, or
    its digest: `convert.topology_forms`), and their tables by digest."""

    def __init__(self, kept: int = KEPT) -> None:
        self._kept = kept
        self._by_digest: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        # id(inline form) -> (the inline form, kept alive for its id; the digest form)
        self._referenced: collections.OrderedDict[int, tuple[bytes, bytes]] = (
            collections.OrderedDict()
        )

    def keep(self, inline: bytes, referenced: bytes, digest: bytes, table: bytes) -> None:
        """A topology told in its `inline` form, whose `referenced` form names `table` by
        `digest`."""
        self._by_digest[digest] = table
        self._referenced[id(inline)] = (inline, referenced)
        while len(self._by_digest) > self._kept:
            self._by_digest.popitem(last=False)
        while len(self._referenced) > self._kept:
            self._referenced.popitem(last=False)

    def by_digest(self, item: bytes) -> bytes:
        """`item` (a serialized event) as a node that asked for tables by digest is sent it."""
        held = self._referenced.get(id(item))
        return held[1] if held is not None and held[0] is item else item

    def table(self, digest: bytes) -> bytes:
        """The compressed table of `digest`; MissedTableChange when it is not held (an older
        generation's, or none told)."""
        table = self._by_digest.get(digest)
        if table is None:
            raise MissedTableChange(
                f"the scheduler holds no peer table {digest.hex()[:16]}: a newer topology "
                "replaced it (the node reconnects for the newest)"
            )
        return table


class EventWire:
    """The events as the streams send them: each serialized once for every stream (the
    topology once per generation: it goes to every node, and is large), and the tables by
    digest."""

    def __init__(self) -> None:
        self.tables = Tables()
        self._topology: tuple[state.TopologyReadyEvent, bytes] | None = None
        # The Shutdown event as sent: a stream ends after writing this very object.
        self.final: bytes | None = None

    def serialized(self, event: state.Event) -> bytes:
        if isinstance(event, state.TopologyReadyEvent):
            cached = self._topology
            if cached is None or cached[0] is not event:
                inline, referenced = convert.topology_forms(convert.event_to_pb(event))
                if referenced is not None:
                    self.tables.keep(inline, *referenced)
                cached = self._topology = (event, inline)
            return cached[1]
        if isinstance(event, state.ShutdownEvent):
            if self.final is None:
                self.final = convert.event_to_pb(event).SerializeToString()
            return self.final
        return convert.event_to_pb(event).SerializeToString()

    def by_digest(self, item: bytes) -> bytes:
        return self.tables.by_digest(item)

    def topology_change(
        self, event: state.TopologyReadyEvent, previous: state.TopologyReadyEvent | None
    ) -> bytes:
        """`event` for the open streams, which were all told `previous` (or a newer catch-up:
        a stream's first topology is the whole table): only the rows that changed since, when
        that is smaller than the whole table. Serialized once for every stream."""
        rows = (
            None
            if previous is None or previous.generation >= event.generation
            else topology.changed_rows(previous.peers, event.peers)
        )
        if previous is None or rows is None:
            return self.serialized(event)
        return convert.topology_delta_to_pb(event, previous.generation, rows).SerializeToString()
