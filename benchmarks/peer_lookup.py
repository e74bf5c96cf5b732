"""Peer table micro-benchmark: what one worker spends on the table when a job forms, per step.

The table is made as the scheduler makes it (`cluster.scheduler.convert.event_to_pb`: N workers,
8 to a host, compressed when large) and serialized; each figure is the best of `--repeat` runs of
one worker's step, in one process, on the message as it comes off the wire:

- parse the event (protobuf; the compressed table is a bytes field, a view),
- inflate + parse the table (`peer_table.inflate`: zlib, then protobuf's C parse: O(N)),
- find its row and make its view (`convert.stream_event`: O(1) for a numeric id, O(log N) by
  bisection for another; "old way" replays how the worker found it before: a numeric id's
  rank, else a scan of `list(node_ids)`),
- rank 0's host (`Topology.peer(0)`, what cluster.torch asks) and the whole table as objects
  (`Topology.peers`, only when asked: `cluster.get_peers()`),
- a one-row delta after a rejoin (`peer_table.table_of`: laid over the table; "old way" copies the
  table and assigns the row),
- behind a relay (#30): the relay's check, parse and lay-out of the table once for its host
  ("host share": `relay.SharedTables`, a sealed memory file), and what each worker then pays to
  map it and find its row ("map+row": `table_file.open_shared`, `convert.stream_event`), read
  rank 0's host and build every row from the mapping; "shared KiB" is the file's size, one copy
  per host.

Usage: python benchmarks/peer_lookup.py [--sizes 8192,65536] [--repeat 20]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Callable, Sequence

from cluster.protocol import records as state
from cluster.protocol.environment import from_env
from cluster.protocol.records import NodeRole
from cluster.protocol.topology import Topology
from cluster.scheduler import convert
from cluster.transport import relay, table_file
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import convert as worker_convert
from cluster.worker import peer_table
from cluster.worker.machine import steps


def peers(
    n: int, numeric: bool, port: Callable[[int], int] = lambda r: 30000 + r
) -> tuple[state.PeerInfo, ...]:
    rows = [
        (
            str(r) if numeric else f"worker-{r:06d}",
            f"10.{r // 8 // 65536}.{r // 8 // 256 % 256}.{r // 8 % 256}",
        )
        for r in range(n)
    ]
    if not numeric:  # a numeric id is its rank; the others go by (host, node id)
        rows.sort(key=lambda row: (row[1], row[0]))
    return tuple(
        state.PeerInfo(r, node_id, host, port(r), NodeRole.WORKER, r % 8, 8)
        for r, (node_id, host) in enumerate(rows)
    )


def old_row(table: pb.PeerTable, node_id: str) -> int:
    """How a worker found its row before: a numeric id's rank, else a scan of every id."""
    if node_id.isdigit() and table.node_ids[int(node_id)] == node_id:
        return int(node_id)
    return list(table.node_ids).index(node_id)


def best_us(step: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def formed(table: tuple[state.PeerInfo, ...]) -> state.TopologyReadyEvent:
    return state.TopologyReadyEvent(generation=1, peers=table, rollback_step=0, reason="formed")


def too_small(n: int) -> str | None:
    """Why `n` workers cannot be measured, or None: a table of at most COMPRESS_TABLE_ABOVE
    bytes travels uncompressed, and a relay shares only a compressed one."""
    for numeric in (True, False):
        if not convert.event_to_pb(formed(peers(n, numeric))).topology_ready.peers_zlib:
            return (
                f"--sizes {n}: a table of {n} workers travels uncompressed (at most "
                f"{convert.COMPRESS_TABLE_ABOVE} bytes) and no relay shares it; give 256 or more"
            )
    return None


def measure(n: int, numeric: bool, repeat: int) -> dict[str, float]:
    table = peers(n, numeric)
    event = formed(table)
    wire = convert.event_to_pb(event).SerializeToString()
    me = table[n // 2]
    config = from_env(
        {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": str(n), "MS_SCHED_HOST": "127.0.0.1"}
        | {"MS_SCHED_PORT": "8118", "MS_NODE_ID": me.node_id}
    )

    def received() -> pb.Event:
        message = pb.Event.FromString(wire)
        peer_table.inflate(message.topology_ready)
        return message

    message = received()
    ready = message.topology_ready

    def view() -> Topology:
        told = worker_convert.stream_event(message, config, me.node_id, ready.peers, host=me.host)
        if not isinstance(told, steps.TopologyReady) or told.topology.rank != me.rank:
            raise AssertionError(f"worker {me.node_id} did not find its row: {told}")
        return told.topology

    moved = tuple(
        p if p.rank != 7 else state.PeerInfo(7, p.node_id, p.host, 9999, p.role, p.local_rank, 8)
        for p in table
    )
    later = state.TopologyReadyEvent(generation=2, peers=moved, rollback_step=0, reason="rejoin")
    delta = pb.Event.FromString(
        convert.topology_delta_to_pb(later, 1, [7]).SerializeToString()
    ).topology_ready

    def delta_old_way() -> pb.PeerTable:
        whole = pb.PeerTable()
        whole.CopyFrom(ready.peers)
        for column in (
            "ranks",
            "node_ids",
            "hosts",
            "ports",
            "roles",
            "local_ranks",
            "local_sizes",
        ):
            getattr(whole, column)[7] = getattr(delta.peers, column)[0]
        return whole

    compressed = convert.event_to_pb(event).topology_ready.peers_zlib
    digest = hashlib.sha256(compressed).digest()
    answer = pb.PeerTableResponse(peers_zlib=compressed).SerializeToString()
    shared = relay.SharedTables()
    path = shared.path(digest, answer)
    assert path is not None

    def share() -> None:
        fresh = relay.SharedTables()
        fresh.path(digest, answer)
        fresh.close()

    def mapped_view() -> Topology:
        mapped = table_file.open_shared(path, digest)
        told = worker_convert.stream_event(message, config, me.node_id, mapped, host=me.host)
        if not isinstance(told, steps.TopologyReady) or told.topology.rank != me.rank:
            raise AssertionError(f"worker {me.node_id} did not find its row: {told}")
        return told.topology

    figures = {
        "wire KiB": len(wire) / 1024,
        "parse event": best_us(lambda: pb.Event.FromString(wire), repeat),
        "inflate+parse table": best_us(received, repeat),
        "row+view": best_us(view, repeat),
        "row, old way": best_us(lambda: old_row(ready.peers, me.node_id), repeat),
        "peer(0)": best_us(lambda: view().peer(0).host, repeat),
        "all peers": best_us(lambda: view().peers, max(3, repeat // 4)),
        "delta": best_us(lambda: peer_table.table_of(delta, (1, ready.peers)), repeat),
        "delta, old way": best_us(delta_old_way, repeat),
        "shared KiB": os.fstat(int(path.rpartition("/")[2])).st_size / 1024,
        "host share": best_us(share, max(3, repeat // 4)),
        "map+row": best_us(mapped_view, repeat),
        "mapped peer(0)": best_us(lambda: mapped_view().peer(0).host, repeat),
        "mapped all": best_us(lambda: mapped_view().peers, max(3, repeat // 4)),
    }
    shared.close()
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8192,65536")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    keys: list[str] = []
    lines: list[tuple[str, dict[str, float]]] = []
    sizes = [int(s) for s in args.sizes.split(",")]
    for why in filter(None, map(too_small, sizes)):
        parser.error(why)
    for n in sizes:
        for numeric in (True, False):
            figures = measure(n, numeric, args.repeat)
            keys = list(figures)
            lines.append((f"{n} {'numeric' if numeric else 'named'}", figures))
    print("per worker, microseconds (best of runs); wire KiB: the TopologyReady as sent")
    print(f"{'N ids':>14} | " + " | ".join(f"{k:>12}" for k in keys))
    for label, figures in lines:
        print(f"{label:>14} | " + " | ".join(f"{figures[k]:12.1f}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
