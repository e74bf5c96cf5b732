"""Scale model: what one scheduler carries for N workers now, and with a tree of relays.

A simulation, not a measurement: it builds the job (N workers, `--per-host` to a host, real
peer tables serialized with the real protobuf message) and counts, for each design, the
connections the scheduler holds, the messages and bytes it sends while the job forms, after one
rejoin, and each second of the steady state, and the CPU and memory those cost at the
per-node figures measured by benchmarks/rendezvous.py and benchmarks/heartbeats.py (given as
options, defaults from the README's Scale section).

Designs:

current
    Every worker holds one connection to the scheduler; the scheduler sends every worker the
    whole peer table (one pre-serialized message for all) when the job forms; a rejoin sends
    the open streams only the changed rows (a delta) and the rejoined worker the whole table.

relays (built)
    What `mscluster run` does today: one relay per host holds the host's one connection to the
    scheduler and forwards each worker's calls (a Watch stream, a Heartbeat stream and its
    calls per worker at the scheduler); a large table is sent once per host (by digest, the
    relay answers its workers). Its CPU and memory per worker are the ones measured behind
    relays (RELAYED_*).

aggregated (designed)
    The next step (docs/design/scale.md, "Aggregation"): one relay per host (the host's launcher,
    `mscluster run`, which starts the host's workers already) holds the host's one connection to
    the scheduler, registers the host's workers in
    one message, and passes events on to them locally; past `--fanout` hosts, relays are
    themselves grouped under relays of relays (a tree of that fan-out), so the scheduler talks
    to at most `--fanout` children. The table still reaches every worker (the API gives every
    worker every peer), but each link carries it once.

Usage: python benchmarks/scale_model.py [--sizes 8192,16384,100000,1000000] [--per-host 8]
       [--fanout 64] [--interval S] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.protocol.config import default_heartbeat_interval
from cluster.scheduler import convert
from cluster.v1 import scheduler_pb2 as pb

# Measured per-node figures (README, "Scale"): scheduler CPU per node during a rendezvous of
# 4,096 (connection, registration, answer and the table's write: 5.9 s), its CPU per heartbeat
# message in the steady state (1,024 idle workers, one beat each way per 10 s: 4.7% of a core),
# what an idle connection costs it besides (8,192 idle workers beating every 82 s: 17.5% of a
# core, of which 4.6% the beats; the rest gRPC's core: the connection and its keepalive pings),
# and its memory per node (48 KiB at 2,048 and 4,096, 71 KiB at 8,192).
REGISTER_CPU_S = 0.0014
# Of which the state machine's decision (benchmarked alone: 8,192 registrations in 0.6 s); the
# rest is the node's connection and calls, which a relay takes over.
DECIDE_CPU_S = 0.000075
# Memory for one member's record in the state machine (no connection).
MEMBER_B = 1024
BEAT_CPU_S = 0.00023
CONNECTION_CPU = 1.57e-5  # cores per idle connection
RSS_PER_NODE_B = 71 * 1024
# CPU per byte written to a stream (gRPC framing and the copy into its buffers; counted apart
# from REGISTER_CPU_S only for the bytes the design adds or removes).
SEND_CPU_S_PER_B = 1e-9
# Measured behind relays as built (README, "Scale"; benchmarks/RESULTS.md): the scheduler's CPU
# per worker to form (65,536 workers behind 64 relays, the workers on the local hop: 16.3 s),
# its cores per idle worker in the steady state (8,192 behind 8 relays, beats batched and the
# event streams on one link per host: 0.8% of a core) and its memory per idle worker (9.7 KiB:
# a slot's task and coroutine).
RELAYED_REGISTER_CPU_S = 0.00025
RELAYED_IDLE_CPU = 0.008 / 8192
RELAYED_RSS_PER_NODE_B = int(9.7 * 1024)
NODE_TIMEOUT_S = 30.0
# A relay sends its host's beats batched, once a second at most (cluster.tools.relay).
BATCH_S = 1.0


@dataclass(frozen=True)
class Figures:
    design: str
    workers: int
    connections: int  # held by the scheduler
    table_bytes: int  # one whole peer table message
    form_messages: int  # sent by the scheduler while the job forms (answers and tables)
    form_bytes: int
    rejoin_messages: int  # sent by the scheduler after one worker rejoined
    rejoin_bytes: int
    beats_per_s: float  # heartbeats the scheduler reads and writes, steady state
    form_cpu_s: float  # scheduler CPU to form the job
    steady_cpu: float  # scheduler cores busy in the steady state
    rss_b: int  # scheduler memory for its connections
    network_bytes: int  # on every network link while the job forms (all copies of the table)


def host_address(host: int) -> str:
    return f"10.{host >> 16 & 255}.{host >> 8 & 255}.{host & 255}"


def table_event(n: int, per_host: int, rows: Sequence[int] | None = None) -> bytes:
    """The TopologyReady event of a job of `n` workers (`per_host` to a host), whole or only
    `rows` (a delta), serialized as the scheduler sends it."""
    picked = range(n) if rows is None else rows
    hosts = [host_address(r // per_host) for r in picked]
    table = pb.PeerTable(
        ranks=list(picked),
        node_ids=[str(r) for r in picked],
        hosts=hosts,
        ports=[29500 + r % per_host for r in picked],
        roles=[pb.ROLE_WORKER] * len(hosts),
        local_ranks=[r % per_host for r in picked],
        local_sizes=[per_host] * len(hosts),
    )
    if rows is None:  # compressed as the scheduler compresses a whole table
        ready = convert.whole_table(pb.TopologyReady(generation=1), table)
    else:
        ready = pb.TopologyReady(generation=2, peers=table, delta_from=1, changed_rows=rows)
    return pb.Event(topology_ready=ready).SerializeToString()


ANSWER_BYTES = len(
    pb.Event(
        accepted=pb.Accepted(cluster_id="0123456789ab", registered=1, expected=1)
    ).SerializeToString()
)


def current(n: int, per_host: int, interval_s: float) -> Figures:
    table = len(table_event(n, per_host))
    delta = len(table_event(n, per_host, [n // 2]))
    form_bytes = n * (ANSWER_BYTES + table)
    return Figures(
        design="current",
        workers=n,
        connections=n,
        table_bytes=table,
        form_messages=2 * n,
        form_bytes=form_bytes,
        rejoin_messages=n,
        rejoin_bytes=(n - 1) * delta + table,
        beats_per_s=2 * n / interval_s,
        form_cpu_s=n * REGISTER_CPU_S + form_bytes * SEND_CPU_S_PER_B,
        steady_cpu=2 * n / interval_s * BEAT_CPU_S + n * CONNECTION_CPU,
        rss_b=n * RSS_PER_NODE_B,
        network_bytes=form_bytes,
    )


def relays_built(n: int, per_host: int, interval_s: float) -> Figures:
    """Relays as built: a connection per host, the workers' event streams on one link per host
    (an event for all of them sent once), their beats batched, the table once per host (by
    digest), at the per-worker costs measured behind relays."""
    table = len(table_event(n, per_host))
    hosts = math.ceil(n / per_host)
    delta = len(table_event(n, per_host, [n // 2]))
    digest_event = len(
        pb.Event(
            topology_ready=pb.TopologyReady(generation=1, peers_digest=b"d" * 32)
        ).SerializeToString()
    )
    small = table <= convert.COMPRESS_TABLE_ABOVE
    # Each worker's answer is its own message on its host's link; an event for every worker (the
    # table, or its digest, a delta) goes down once per host (HostWatch).
    form_bytes = n * ANSWER_BYTES + hosts * (table if small else digest_event + table)
    return Figures(
        design=f"relays, built ({per_host}/host)",
        workers=n,
        connections=hosts,
        table_bytes=table,
        form_messages=n + hosts * (1 if small else 2),
        form_bytes=form_bytes,
        rejoin_messages=hosts,
        rejoin_bytes=hosts * delta + (table if small else digest_event + table),
        # A host's batch carries the beats heard within BATCH_S: at most one a worker a beat.
        beats_per_s=hosts * min(per_host, interval_s / BATCH_S) / interval_s,
        form_cpu_s=n * RELAYED_REGISTER_CPU_S + form_bytes * SEND_CPU_S_PER_B,
        steady_cpu=n * RELAYED_IDLE_CPU,
        rss_b=n * RELAYED_RSS_PER_NODE_B,
        network_bytes=(hosts if not small else n) * table,
    )


def relays(n: int, per_host: int, fanout: int, interval_s: float) -> Figures:
    """The tree: hosts are the leaves' parents; levels of relays of `fanout` above them until
    the scheduler has at most `fanout` children. Counted by walking the levels."""
    table = len(table_event(n, per_host))
    delta = len(table_event(n, per_host, [n // 2]))
    level = math.ceil(n / per_host)  # relays at the bottom level: one per host
    children_of_scheduler = level
    links_above_workers = level  # every relay's link to its parent carries the table once
    while children_of_scheduler > fanout:
        children_of_scheduler = math.ceil(children_of_scheduler / fanout)
        links_above_workers += children_of_scheduler
    # A registration carries a host's workers (one message per child); each child gets one
    # answer and one table; the relays pass both on down their subtree.
    sent = children_of_scheduler * (ANSWER_BYTES + table)
    # A relay shares the table with its host's workers locally (not on the network).
    network = links_above_workers * table
    return Figures(
        design=f"aggregated (fan-out {fanout})",
        workers=n,
        connections=children_of_scheduler,
        table_bytes=table,
        form_messages=2 * children_of_scheduler,
        form_bytes=sent,
        rejoin_messages=children_of_scheduler,
        rejoin_bytes=children_of_scheduler * delta,
        beats_per_s=2 * children_of_scheduler / interval_s,
        # The scheduler still decides every node (ranks, state), without a connection each.
        form_cpu_s=n * DECIDE_CPU_S
        + children_of_scheduler * (REGISTER_CPU_S - DECIDE_CPU_S)
        + sent * SEND_CPU_S_PER_B,
        steady_cpu=2 * children_of_scheduler / interval_s * BEAT_CPU_S
        + children_of_scheduler * CONNECTION_CPU,
        rss_b=children_of_scheduler * RSS_PER_NODE_B + n * MEMBER_B,
        network_bytes=network,
    )


def human(value: float, unit: str = "B") -> str:
    for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(value) < 1024 or prefix == "Ti":
            return f"{value:.0f} {prefix}{unit}" if prefix == "" else f"{value:.1f} {prefix}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="8192,16384,100000,1000000")
    parser.add_argument("--per-host", type=int, default=8, help="workers per host")
    parser.add_argument("--fanout", type=int, default=64, help="children per relay of relays")
    parser.add_argument("--interval", type=float, help="heartbeat interval (default: the job's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    rows: list[Figures] = []
    for n in sizes:
        interval = args.interval or default_heartbeat_interval(NODE_TIMEOUT_S, n)
        rows.append(current(n, args.per_host, interval))
        rows.append(relays_built(n, args.per_host, interval))
        rows.append(relays(n, args.per_host, args.fanout, interval))
    header = (
        f"{'N':>7} | {'design':<28} | {'conns':>6} | {'table':>9} | {'form: sent':>10} | "
        f"{'network':>10} | {'rejoin':>9} | {'beats/s':>7} | {'form CPU':>8} | "
        f"{'steady':>6} | {'RSS':>9}"
    )
    print(header)
    print("-" * len(header))
    for f in rows:
        print(
            f"{f.workers:>7} | {f.design:<28} | {f.connections:>6} | {human(f.table_bytes):>9} | "
            f"{human(f.form_bytes):>10} | {human(f.network_bytes):>10} | "
            f"{human(f.rejoin_bytes):>9} | {f.beats_per_s:>7.0f} | {f.form_cpu_s:>7.1f}s | "
            f"{f.steady_cpu:>6.1%} | {human(f.rss_b):>9}"
        )
    print(
        "(form: bytes the scheduler sends while the job forms; network: every copy of the "
        "table on a network link (a relay hands it to its host's workers locally); rejoin: "
        "bytes the scheduler sends after one rejoin; steady: scheduler cores busy with "
        "heartbeats)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(f) for f in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
