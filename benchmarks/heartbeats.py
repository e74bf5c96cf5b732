"""Heartbeat load: what N formed, idle workers cost the server, per second of the job's life.

cluster (the system under test)
    A real scheduler process (`SchedulerServer`, port 0; the heartbeat interval a job of N
    workers gets by default at MS_NODE_TIMEOUT=30, or `--interval`); N
    simulated workers (`WorkerAgent`s, spread over `--procs` client processes) join it. Once
    every worker holds the peer table the parent measures, over `--window` seconds, the CPU time
    of the scheduler process and of the client processes. Meanwhile every agent makes one
    `Heartbeat` call per interval and the scheduler writes its own heartbeat on every stream
    once per interval (the idle sweep), as in a real job between collectives.

torch TCPStore (the peer, when torch is importable)
    What torch's elastic c10d rendezvous does to keep its members alive: every member writes its
    own keep-alive key to the store every `keep_alive_interval` (5 s by default, or `--interval`).
    Here a TCPStore server process and N clients (one connection each, threads over `--procs`
    processes), each setting "hb/<i>" to the time once per interval, the first beat at a random
    point of the first interval. The same window is measured.

Name resolution as in rendezvous.py (RES_OPTIONS=use-vc, so that no TCPStore client's reverse
lookup is lost to a dropped UDP packet).

Both: the figure is CPU seconds per second of wall time (1.0 = one core busy), the server's and
the clients' summed. The window starts after every worker is in and beating.

--metrics: the scheduler serves its Prometheus metrics (as with CLUSTER_METRICS_PORT), and the
parent scrapes /metrics every `--scrape-interval` seconds (5; Prometheus's default is 15) during
the window, as a Prometheus server would: the scheduler's figure includes what the scrapes cost.
Compare runs with and without it (interleaved: the machine is shared).

cluster through relays (`--relays K`: the system `cluster-relays`, run beside `cluster`)
    The same scheduler and simulated workers, but the workers of client process k reach the
    scheduler through relay k * K // procs (`cluster.tools.relay.Relay`, each in its own process,
    on a unix socket; --procs is at least K): the scheduler holds K connections instead of N.
    Each worker still makes its own Heartbeat call per interval and holds its own Watch stream
    (a relay forwards calls, it does not merge them). Reported beside the scheduler's: the
    relays' CPU (summed) and, for both cluster systems, the scheduler's TCP connections at the
    end of the window.

Where the scheduler's time goes: with BENCH_PROFILE_DIR set, the scheduler runs under cProfile
during the window only, written to `scheduler-<system>.prof` there (the Python side: gRPC's
own threads are in the CPU figure but not in the profile).

Usage: python benchmarks/heartbeats.py [--workers 1024] [--interval S] [--window 20]
       [--procs 4] [--systems cluster,tcpstore,cluster-relays] [--relays K]
       [--metrics [--scrape-interval 5]]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from multiprocessing.context import SpawnContext
from multiprocessing.queues import Queue as MpQueue
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

from rendezvous import (
    BASE_DATA_PORT,
    HOST,
    JOIN_TIMEOUT_S,
    SPAWN_TIMEOUT_S,
    BenchError,
    Mailbox,
    Message,
    _report_errors,
    children,
    cpu_seconds,
    raise_fd_limit,
    relay_main,
    rss_bytes,
    signalled,
    split,
    systems_with_relays,
    tcpstore_server_main,
    torch_version,
    use_tcp_resolver,
)

# ruff: noqa: PLC0415  (grpc, cluster and torch are imported in the children only)

JOIN_TIMEOUT = 120.0
MIN_WINDOW_S = 20.0
# ... and 10 s more per 1,000 workers: 8,192 simulated workers on 2 cores form in minutes.
JOIN_TIMEOUT_PER_NODE_S = 0.01


def join_timeout(n: int) -> float:
    return JOIN_TIMEOUT + n * JOIN_TIMEOUT_PER_NODE_S


# torch.distributed.elastic's c10d rendezvous: keep_alive_interval's default.
TORCH_KEEP_ALIVE_INTERVAL_S = 5.0


def cluster_server_main(
    n: int,
    interval_s: float,
    q: MpQueue[Message],
    stop: MpEvent,
    metrics: bool = False,
    window: tuple[MpEvent, MpEvent] | None = None,
    name: str = "scheduler",
) -> None:
    """The scheduler; under cProfile between `window`'s two events when BENCH_PROFILE_DIR is
    set (written as `name`.prof there)."""
    raise_fd_limit()

    async def profile_window() -> None:
        import cProfile

        directory = os.environ.get("BENCH_PROFILE_DIR")
        if not directory or window is None:
            return
        opened, closed = window
        if not await signalled(opened, SPAWN_TIMEOUT_S + 10 * JOIN_TIMEOUT):
            return
        profile = cProfile.Profile()
        profile.enable()
        try:
            await signalled(closed, SPAWN_TIMEOUT_S + 10 * JOIN_TIMEOUT)
        finally:
            profile.disable()
            profile.dump_stats(str(Path(directory) / f"{name}.prof"))

    async def serve() -> None:
        from cluster.protocol.config import DEFAULT_NODE_TIMEOUT_S, ObserveConfig
        from cluster.scheduler import JobSettings, SchedulerServer
        from cluster.transport import collector

        settings = JobSettings(
            worker_num=n,
            server_num=0,
            # A real job's: its nodes' silence limit follows a longer interval by itself
            # (config.silence_limit), and gRPC pings every connection for it.
            node_timeout_s=DEFAULT_NODE_TIMEOUT_S,
            topo_timeout_s=join_timeout(n),
            heartbeat_interval_s=interval_s,
        )
        observe = ObserveConfig(metrics_port=0) if metrics else None
        server = SchedulerServer(settings, host=HOST, port=0, observe=observe)
        port = await server.start()
        collector.tune_for_server()  # as the scheduler's own process does
        profiling = asyncio.ensure_future(profile_window())
        try:
            q.put(("port", -1, (port, server.observing.metrics_port)))
            await signalled(stop, SPAWN_TIMEOUT_S + 10 * JOIN_TIMEOUT)
            await asyncio.wait_for(server.wait_done(), 60.0)
        finally:
            profiling.cancel()
            await server.stop()

    _report_errors(q, -1, lambda: asyncio.run(serve()))


def cluster_clients_main(
    index: int,
    ids: list[int],
    n: int,
    port: int,
    q: MpQueue[Message],
    stop: MpEvent,
    relay: str | None = None,
) -> None:
    raise_fd_limit()

    async def run() -> None:
        from cluster.protocol import environment as cluster_config
        from cluster.protocol.errors import ClusterError
        from cluster.transport.channel import SchedulerProbe
        from cluster.worker.agent import WorkerAgent
        from cluster.worker.identity import NodeIdentity, new_incarnation

        fatal: list[ClusterError] = []

        probe = SchedulerProbe()  # the simulated workers share their checks of the scheduler

        def agent(i: int) -> WorkerAgent:
            config = cluster_config.from_env(
                {
                    "MS_ROLE": "MS_WORKER",
                    "MS_WORKER_NUM": str(n),
                    "MS_SCHED_HOST": HOST,
                    "MS_SCHED_PORT": str(port),
                    "MS_NODE_ID": str(i),
                    "MS_TOPO_TIMEOUT": str(join_timeout(n)),
                    **({"CLUSTER_RELAY": relay} if relay else {}),
                }
            )
            identity = NodeIdentity(str(i), new_incarnation(), HOST, BASE_DATA_PORT + i)
            return WorkerAgent(
                config, identity, say=lambda _: None, on_fatal=fatal.append, probe=probe
            )

        agents = [agent(i) for i in ids]
        try:
            await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), join_timeout(n))
            q.put(("in", index, None))
            await signalled(stop, SPAWN_TIMEOUT_S + 10 * JOIN_TIMEOUT)
            if fatal:
                raise BenchError(f"{len(fatal)} agent(s) failed, first: {fatal[0]}")
            await asyncio.wait_for(asyncio.gather(*(a.finish() for a in agents)), 60.0)
        finally:
            await asyncio.gather(*(a.close() for a in agents), return_exceptions=True)
        q.put(("closed", index, None))

    _report_errors(q, index, lambda: asyncio.run(run()))


def tcpstore_clients_main(
    index: int,
    ids: list[int],
    n: int,
    port: int,
    interval_s: float,
    q: MpQueue[Message],
    stop: MpEvent,
) -> None:
    raise_fd_limit()

    def body() -> None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT)
        done = threading.Event()
        joined = threading.Semaphore(0)
        errors: list[str] = []

        def member(i: int) -> None:
            try:
                store = TCPStore(
                    HOST, port, world_size=n, is_master=False, wait_for_workers=False,
                    timeout=timeout,
                )  # fmt: skip
                joined.release()
                if done.wait(random.uniform(0, interval_s)):
                    return
                while True:
                    store.set(f"hb/{i}", str(time.time()))
                    if done.wait(interval_s):
                        return
            except Exception as exc:
                errors.append(f"member {i}: {type(exc).__name__}: {exc}")
                joined.release()

        threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in ids]
        for thread in threads:
            thread.start()
        for _ in ids:
            if not joined.acquire(timeout=JOIN_TIMEOUT):
                raise BenchError("members did not connect in time")
        if errors:
            raise BenchError(f"{len(errors)} member(s) failed, first: {errors[0]}")
        q.put(("in", index, None))
        stop.wait(SPAWN_TIMEOUT_S + 10 * JOIN_TIMEOUT)
        done.set()
        for thread in threads:
            thread.join(10.0)
        q.put(("closed", index, None))

    _report_errors(q, index, body)


def scrape_while(metrics_port: int, every_s: float, until: float, most: int | None = None) -> int:
    """GET /metrics every `every_s` until `until` (monotonic) or `most` scrapes; how many."""
    answered = 0
    while most is None or answered < most:
        started = time.monotonic()
        with urllib.request.urlopen(f"http://{HOST}:{metrics_port}/metrics", timeout=10) as page:
            if b"cluster_nodes" not in page.read():
                raise BenchError("the scheduler's /metrics has no cluster_nodes")
        answered += 1
        pause = every_s - (time.monotonic() - started)
        if time.monotonic() + pause >= until:
            return answered
        time.sleep(max(pause, 0.0))
    return answered


def run(
    ctx: SpawnContext,
    system: str,
    n: int,
    timing: tuple[float, float],
    procs: int,
    scrape_s: float | None = None,
    relays: int = 0,
) -> dict[str, float]:
    """Server and client CPU seconds per wall second over the window, N workers in and beating
    (`timing`: the heartbeat interval and the window's length; `scrape_s`: the cluster
    scheduler serves metrics, scraped this often; cluster-relays: through `relays` relay
    processes)."""
    from cluster.protocol.config import DEFAULT_NODE_TIMEOUT_S

    interval_s, window_s = timing
    relays = relays if system == "cluster-relays" else 0
    procs = min(max(procs, relays), n)
    q: MpQueue[Message] = ctx.Queue()
    stop = ctx.Event()
    relays_stop = ctx.Event()  # after the workers finished and closed: they go through them
    window = (ctx.Event(), ctx.Event())
    sockets = tempfile.TemporaryDirectory(prefix="hb-")
    with sockets, children(ctx) as group:
        box = Mailbox(q, group)
        if system.startswith("cluster"):
            metrics = scrape_s is not None
            args0 = (n, interval_s, q, stop, metrics, window, f"scheduler-{system}")
            server = group.spawn(cluster_server_main, *args0, name="scheduler")
        else:
            # Stopped by the parent; bounded, like every wait here, should the parent die.
            store_timeout_s = SPAWN_TIMEOUT_S + 10 * JOIN_TIMEOUT
            server = group.spawn(tcpstore_server_main, n, q, stop, store_timeout_s, name="store")
        port = box.collect("port", 1, time.monotonic() + SPAWN_TIMEOUT_S)[-1]
        empty_rss = rss_bytes(server.pid)  # before any worker came
        port, metrics_port = port if isinstance(port, tuple) else (port, None)
        addresses = [f"unix:{sockets.name}/relay-{k}.sock" for k in range(relays)]
        for k, address in enumerate(addresses):
            hold_s = SPAWN_TIMEOUT_S + 10 * JOIN_TIMEOUT + join_timeout(n)
            args1 = (k, port, n, address, q, relays_stop, (DEFAULT_NODE_TIMEOUT_S, hold_s))
            group.spawn(relay_main, *args1, name=f"relay-{k}")
        relay_pids = list(
            box.collect("relay-ready", relays, time.monotonic() + SPAWN_TIMEOUT_S).values()
        )
        parts = split(range(n), procs)
        clients = []
        for k, ids in enumerate(parts):
            if system.startswith("cluster"):
                relay = addresses[k * relays // procs] if relays else None
                args: tuple[Any, ...] = (k, ids, n, port, q, stop, relay)
                clients.append(group.spawn(cluster_clients_main, *args, name=f"clients-{k}"))
            else:
                args = (k, ids, n, port, interval_s, q, stop)
                clients.append(group.spawn(tcpstore_clients_main, *args, name=f"clients-{k}"))
        box.collect("in", len(parts), time.monotonic() + SPAWN_TIMEOUT_S + join_timeout(n))
        # One interval first: every worker's beat is on its schedule when the window opens.
        time.sleep(interval_s)
        pids = [server.pid, *(c.pid for c in clients), *relay_pids]
        before = [cpu_seconds(pid) for pid in pids]
        idle_rss = rss_bytes(server.pid)
        window[0].set()
        start = time.monotonic()
        if scrape_s is not None and metrics_port is not None:
            scrape_while(metrics_port, scrape_s, start + window_s)
        time.sleep(max(start + window_s - time.monotonic(), 0.0))
        after = [cpu_seconds(pid) for pid in pids]
        wall = time.monotonic() - start
        window[1].set()
        held = scheduler_connections(server.pid)
        if any(v is None for v in [*before, *after]):
            raise BenchError("a process ended during the window")
        used = [b - a for a, b in zip(before, after, strict=True)]  # type: ignore[operator]
        per_scrape = None
        if scrape_s is not None and metrics_port is not None:
            per_scrape = scrape_cost(metrics_port, server.pid)
        stop.set()
        box.collect("closed", len(parts), time.monotonic() + 120.0)
        relays_stop.set()
        group.join_all(time.monotonic() + JOIN_TIMEOUT_S + 60.0)
    result = {
        "server": used[0] / wall,
        "clients": sum(used[1 : 1 + len(clients)]) / wall,
        "relays": sum(used[1 + len(clients) :]) / wall,
    }
    if held is not None:
        result["connections"] = held
    if empty_rss is not None and idle_rss is not None:
        result["rss_per_node_b"] = (idle_rss - empty_rss) / n
    if per_scrape is not None:
        result["scrape_s"] = per_scrape
    return result


def scheduler_connections(pid: int | None) -> int | None:
    """How many TCP connections process `pid` holds now (None: unknown)."""
    if pid is None:
        return None
    from cluster.scheduler.descriptors import connections

    return len(connections(pid=pid))


def scrape_cost(metrics_port: int, pid: int | None, scrapes: int = 50) -> float:
    """The scheduler's CPU seconds per scrape, over `scrapes` back-to-back scrapes."""
    before = cpu_seconds(pid)
    scrape_while(metrics_port, 0.0, float("inf"), scrapes)
    after = cpu_seconds(pid)
    if before is None or after is None:
        raise BenchError("the scheduler ended while it was scraped")
    return (after - before) / scrapes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument(
        "--interval",
        type=float,
        help="seconds between beats, for both (default: each system's own default)",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=None,
        help="seconds measured (default: one heartbeat interval, at least 20 s, so that every "
        "node's beat falls in it)",
    )
    parser.add_argument("--procs", type=int, default=4, help="client processes")
    parser.add_argument("--systems", default="cluster,tcpstore")
    parser.add_argument(
        "--relays",
        type=int,
        default=0,
        help="K: also run cluster-relays, the workers through K relay processes",
    )
    parser.add_argument(
        "--metrics", action="store_true", help="cluster: serve /metrics, scraped in the window"
    )
    parser.add_argument(
        "--scrape-interval", type=float, default=5.0, help="--metrics: seconds between scrapes"
    )
    args = parser.parse_args(argv)
    if args.scrape_interval <= 0:
        parser.error("--scrape-interval must be > 0")
    if args.interval is not None and args.interval <= 0:
        parser.error("--interval must be > 0")
    if args.workers < 1 or args.procs < 1 or (args.window is not None and args.window <= 0):
        parser.error("--workers and --procs must be >= 1, --interval and --window > 0")
    args.systems = systems_with_relays(parser, args.systems, args.relays)
    known = {"cluster", "tcpstore", "cluster-relays"}
    if not args.systems or set(args.systems) - known:
        parser.error(f"--systems: choose among {', '.join(sorted(known))} (got {args.systems})")
    return args


def report(used: dict[str, float], interval: float, scrape: float | None, relays: int) -> str:
    """One system's line."""
    line = (
        f"one beat per {interval:g} s: server {used['server'] * 100:5.1f}% of a core, "
        f"clients {used['clients'] * 100:5.1f}%"
    )
    if used.get("relays"):
        line += f", {relays} relays {used['relays'] * 100:5.1f}% (summed)"
    if "rss_per_node_b" in used:
        line += f"; server memory {used['rss_per_node_b'] / 1024:.1f} KiB per idle worker"
    if "connections" in used:
        line += f"; scheduler connections: {used['connections']:.0f}"
    if scrape:
        line += f" (metrics scraped every {scrape:g} s)"
    if "scrape_s" in used:
        line += f"; a scrape costs the scheduler {used['scrape_s'] * 1000:.1f} ms of CPU"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    import multiprocessing as mp

    from cluster.protocol.config import DEFAULT_NODE_TIMEOUT_S, default_heartbeat_interval

    args = parse_args(argv)
    cluster_interval = args.interval or default_heartbeat_interval(
        DEFAULT_NODE_TIMEOUT_S, args.workers
    )
    intervals = {
        "cluster": cluster_interval,
        "cluster-relays": cluster_interval,
        "tcpstore": args.interval or TORCH_KEEP_ALIVE_INTERVAL_S,
    }
    raise_fd_limit()
    use_tcp_resolver()
    systems = [s for s in args.systems if s != "tcpstore" or torch_version()]
    ctx = mp.get_context("spawn")
    print(
        f"heartbeats: {args.workers} workers, "
        f"{'one interval' if args.window is None else f'{args.window:g} s'} measured, "
        f"{args.procs} client processes",
        flush=True,
    )
    results = {}
    for system in systems:
        interval = intervals[system]
        scrape = args.scrape_interval if args.metrics and system.startswith("cluster") else None
        window = args.window or max(MIN_WINDOW_S, interval)
        used = results[system] = run(
            ctx, system, args.workers, (interval, window), args.procs, scrape, args.relays
        )
        print(f"  {system:<14} {report(used, interval, scrape, args.relays)}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"heartbeat benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
