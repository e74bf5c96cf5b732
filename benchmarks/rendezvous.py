"""Rendezvous benchmark: time from "all workers started" to "every worker has the whole peer table".

Two implementations run the same workload, N simulated workers spread over `--procs` client
processes (multiprocessing, "spawn" start method), against one server in its own process:

cluster (the system under test)
    Server: `cluster.scheduler.SchedulerServer` (a real grpc.aio scheduler, port 0) in its own
    process, expecting N workers.
    Each simulated worker is one `cluster.worker.agent.WorkerAgent` with its own gRPC channel
    (its own TCP connection), all agents of a client process on that process's asyncio loop.
    After the start signal each worker: creates its agent (channel), `agent.start()`, which
    registers (its address) and opens its event stream (in the current protocol one Watch
    stream whose first message is the registration), then reads events until TopologyReady
    arrives with the N peers. Its time is taken when `start()`
    returns; `topology.size == N` is checked (the table as received; `topology.peers`, the
    Peer records, may be built lazily on first use, so one agent per process checks every
    entry of it after the clock has stopped, as one TCPStore client per process does).
    Outside the timing: `agent.finish()` (Finish RPC) and `agent.close()`; the scheduler sees
    every node finished, ends the job and its process exits.

torch TCPStore (the peer, when torch is importable)
    Server: `torch.distributed.TCPStore(127.0.0.1, port=0, world_size=N, is_master=True,
    wait_for_workers=False)` (default backend, libuv) in its own process.
    Each simulated worker is one blocking TCPStore client object (its own TCP connection) on its
    own thread; the threads of a client process are created before the start signal and wait
    on a threading.Event. After the start signal each worker: constructs its client
    (`is_master=False, wait_for_workers=False`: connect + handshake), `set("addr/<i>", address)`,
    `n = add("count", 1)`; the worker whose add returns N does `set("done", "1")`; every worker
    `wait(["done"])` then `multi_get(["addr/0", ..., "addr/<N-1>"])`. Its time is taken when
    multi_get has returned the N addresses (count checked; one client per process checks every
    value). Outside the timing: the clients are
    dropped (connections closed) and the server process is stopped.

gRPC floor (`--systems grpc,grpc-tls`, for the TLS figure)
    Server: a bare grpc.aio server with only the standard health service, plaintext or with the
    scheduler's mutual-TLS credentials (the same PKI, no CRL). Each simulated worker opens its
    own channel (`cluster.channel.open_channel`, one connection each) and makes one empty
    health Check. No table, no registration: what one connection and one call cost in gRPC,
    so that the TLS ratio of cluster can be read against gRPC's own.

Both sides: one connection per worker, the worker publishes its address, the server counts the
workers, and every worker ends up holding the N addresses. Client processes import everything
and initialise their runtime (grpc.aio / torch.distributed) before they report ready, so process
spawn and import time are excluded. The parent then takes `t0 = time.time()` and sets a
multiprocessing Event; each client process reports the wall time at which its last worker had
the full table; the figure of a run is `max(those) - t0` (it includes the Event wake-up).

Name resolution: every TCPStore client does a reverse DNS lookup (getnameinfo) of the store's
address when it connects. Where the resolver answers over UDP and drops packets under a burst
(as the sandbox this was written in does: 64 concurrent lookups already hit glibc's 5 s
retransmit timeout), TCPStore would be charged 5-10 s of resolver timeouts per run. By default
(`--resolver tcp`) the benchmark therefore sets RES_OPTIONS=use-vc for all its processes, so that
glibc asks over TCP: the lookups are still made and timed, but none is lost (that sandbox's
resolver refuses TCP at once, so each lookup costs about a millisecond, like an answered UDP
query, and torch logs a warning per client, which TORCH_CPP_LOG_LEVEL=ERROR silences).
`--resolver system` leaves the resolver as configured. cluster makes no DNS lookups here (the
addresses are IP literals and gRPC does not reverse-resolve).

cluster through relays (`--relays K`: the system `cluster-relays`, run beside `cluster`)
    The same scheduler and simulated workers, but the workers of each client process reach the
    scheduler through one of K relays (`cluster.tools.relay.Relay`, each in its own process,
    on a unix socket; client process k uses relay k * K // procs, so --procs is at least K):
    the scheduler holds K connections instead of N. Reported beside the wall time and the
    scheduler's CPU: the relays' CPU (summed) and, for both cluster systems, the scheduler's
    peak count of TCP connections (`scheduler connections: peak P`, sampled from /proc every
    second by the parent and once more when the last worker holds its table).

Second part (`--real 8`, 0 to skip): a real job of 8 worker processes, each a spawned process
that imports `cluster`, grpc and `cluster.worker.session` (what `init()` imports), records
`started = time.time()`, then calls
`cluster.init()` (MS_* environment, scheduler spawned beforehand) and records `returned`. The
figure is `max(returned) - max(started)`: how long the last process to start waits for the
job to form. Every process then calls `cluster.finalize()`.

Reported per run besides the wall time: cluster's stages (when each worker was connected, had
its registration accepted, held the table: median and last, after the start signal), the
finish storm's length, the event-loop lag of the scheduler and of the client processes (how late
a 0.1 s timer ran, at most), the server's CPU and RSS growth per node, and the client processes'
CPU and peak RSS per node. BENCH_PROFILE_DIR=dir writes cProfile files of the scheduler and the
client processes there.

Usage: python benchmarks/rendezvous.py [--sizes 8,64,256,1024] [--repeat 3] [--procs auto|N]
       [--real 8] [--timeout S] [--retries 2]
       [--systems cluster,tcpstore,cluster-tls,cluster-tls-crl,grpc,grpc-tls,cluster-relays]
       [--relays K] [--resolver tcp|system] [--nice N] [--json PATH]

`--nice N` runs every system's client processes (and the relays) at niceness N, the servers at
the parent's: a way to give the scheduler the CPU it would have on a machine of its own, for runs
whose hundred-odd processes would otherwise starve it on a small machine. Say so with a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import importlib
import json
import logging
import multiprocessing as mp
import os
import platform
import queue
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.context import SpawnContext, SpawnProcess
from multiprocessing.queues import Queue as MpQueue
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

HOST = "127.0.0.1"
# The advertised data-plane port of simulated worker i (never bound: it is only an address).
BASE_DATA_PORT = 30000
_PORTS = 65536 - BASE_DATA_PORT


def data_address(i: int) -> tuple[str, int]:
    """Simulated worker i's advertised address (host, port): HOST and BASE_DATA_PORT + i, the
    host's third byte counting on past the last port (at 35,536 workers and more)."""
    return f"127.0.{i // _PORTS}.1", BASE_DATA_PORT + i % _PORTS


# How long a spawned process may take to import and report ready.
SPAWN_TIMEOUT_S = 60.0
# A run's default bound: TCPStore's rendezvous grows with N x N (100 s at 4,096 workers).
MIN_TIMEOUT_S = 180.0
TIMEOUT_PER_NODE_S = 0.06
# How long a process gets to exit by itself before it is terminated, then killed.
JOIN_TIMEOUT_S = 15.0

# MS_NODE_TIMEOUT of the simulated workers. A client process runs 1,024 of them on one event
# loop, and on a busy 2-core machine that loop lags by up to 15 s while the job forms and the
# tables arrive: their heartbeats are late together, which a real worker (a process of its own)
# is not, and at MindSpore's 30 s the scheduler took that harness for 1,024 hung workers.
SIMULATED_NODE_TIMEOUT_S = 60
# Imports of grpc, cluster and torch are local to the children, deliberately.
# ruff: noqa: PLC0415


# -- process plumbing ------------------------------------------------------------------------


class BenchError(RuntimeError):
    pass


Message = tuple[str, int, Any]  # (kind, process index, payload)


class Children:
    """Spawned processes of one run; whatever is still alive at exit is terminated, then killed."""

    def __init__(self, ctx: SpawnContext) -> None:
        self.ctx = ctx
        self.procs: list[SpawnProcess] = []

    def spawn(self, target: Callable[..., None], *args: Any, name: str) -> SpawnProcess:
        proc = self.ctx.Process(target=target, args=args, name=name, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def join_all(self, deadline: float) -> None:
        """Wait for every child to exit by itself; raise if one does not or exits non-zero."""
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                raise BenchError(f"{proc.name} did not exit in time")
            if proc.exitcode != 0:
                raise BenchError(f"{proc.name} exited with code {proc.exitcode}")

    def reap(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        self.procs.clear()


@contextlib.contextmanager
def children(ctx: SpawnContext) -> Iterator[Children]:
    group = Children(ctx)
    try:
        yield group
    finally:
        group.reap()


class Mailbox:
    """Messages from the children of one run, taken by kind; other kinds wait their turn."""

    def __init__(self, q: MpQueue[Message], group: Children) -> None:
        self.q = q
        self.group = group
        self.stash: list[Message] = []

    def collect(self, kind: str, count: int, deadline: float) -> dict[int, Any]:
        """`count` messages of `kind` (one per process index), or BenchError on error/death/time."""
        got: dict[int, Any] = {}
        for message in [m for m in self.stash if m[0] == kind][:count]:
            self.stash.remove(message)
            got[message[1]] = message[2]
        while len(got) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"timed out waiting for {count - len(got)} '{kind}' message(s)")
            try:
                what, index, payload = self.q.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [p for p in self.group.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise BenchError(
                        f"{dead[0].name} died with exit code {dead[0].exitcode} while waiting "
                        f"for '{kind}'"
                    ) from None
                continue
            if what == "error":
                raise BenchError(f"child {index}: {payload}")
            if what == kind:
                got[index] = payload
            else:
                self.stash.append((what, index, payload))
        return got


def split(ids: Sequence[int], parts: int) -> list[list[int]]:
    """Contiguous, near-equal chunks."""
    size, extra = divmod(len(ids), parts)
    out: list[list[int]] = []
    start = 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        out.append(list(ids[start:end]))
        start = end
    return out


def _report_errors(q: MpQueue[Message], index: int, body: Callable[[], None]) -> None:
    try:
        body()
    except BaseException as exc:
        q.put(("error", index, f"{type(exc).__name__}: {exc}"))
        raise


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process so far (Linux /proc), or None."""
    from cluster.tools.testing import cpu_seconds as process_cpu_s

    if pid is None:
        return None
    try:
        return process_cpu_s(pid)
    except (OSError, ValueError, IndexError):
        return None


def rss_bytes(pid: int | None) -> int | None:
    """Resident set size of a process now (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# The open-files limit a process of the benchmark asks for: a scheduler of N nodes holds N
# connections, and a client process one per agent (as root, the hard limit is raised too).
WANT_OPEN_FILES = 65536


def lower_priority() -> None:
    """A client or relay process: run at the niceness `--nice` asked for (BENCH_CLIENT_NICE)."""
    nice = int(os.environ.get("BENCH_CLIENT_NICE", "0") or "0")
    if nice:
        os.nice(nice)


def raise_fd_limit() -> int:
    """Raise this process's open-files limit as far as it may go; the limit it has now."""
    try:
        import resource
    except ImportError:
        return WANT_OPEN_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if hard != infinite and hard < WANT_OPEN_FILES:
        with contextlib.suppress(ValueError, OSError):  # needs CAP_SYS_RESOURCE
            resource.setrlimit(resource.RLIMIT_NOFILE, (WANT_OPEN_FILES, WANT_OPEN_FILES))
            soft, hard = WANT_OPEN_FILES, WANT_OPEN_FILES
    want = WANT_OPEN_FILES if hard == infinite else hard
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return int(soft) if soft != infinite else WANT_OPEN_FILES


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class LagProbe:
    """How late this process's event loop runs a timer due every `every_s`: the loop's lag
    (its largest value), the time a callback waits behind the others' work."""

    def __init__(self, every_s: float = 0.1) -> None:
        self.every_s = every_s
        self.max_s = 0.0
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + every_s
        self._timer = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        now = self._loop.time()
        self.max_s = max(self.max_s, now - self._due)
        self._due = now + self.every_s
        self._timer = self._loop.call_at(self._due, self._tick)

    def stop(self) -> float:
        self._timer.cancel()
        return self.max_s


def tls_identity(ssl_json: str | None, *, server: bool) -> Any:
    """The process's TLS identity from `ssl_json` (None: plaintext). Call it before grpc is
    imported: grpc reads the cipher list once, when it is imported."""
    if not ssl_json:
        return None
    from cluster.protocol.config import TLSOptions
    from cluster.transport import tls

    return tls.prepare(TLSOptions(config_path=Path(ssl_json)), server=server)


async def signalled(signal: MpEvent, timeout_s: float) -> bool:
    """Wait for the parent's `signal` without blocking the loop; False if it did not come."""
    loop = asyncio.get_running_loop()
    return bool(await loop.run_in_executor(None, signal.wait, timeout_s))


async def timed(
    index: int,
    ids: list[int],
    one: Callable[[int], Awaitable[float]],
    start: MpEvent,
    q: MpQueue[Message],
    timeout_s: float,
) -> None:
    """Report ready, wait for the start signal, then run `one(i)` for every worker of this
    process and report when the last one had its table, and the CPU used meanwhile."""
    q.put(("ready", index, None))
    if not await signalled(start, SPAWN_TIMEOUT_S + timeout_s):
        raise BenchError("no start signal")
    cpu0 = time.process_time()
    lag = LagProbe()
    try:
        finished = await asyncio.wait_for(asyncio.gather(*(one(i) for i in ids)), timeout_s)
    finally:
        lag_s = lag.stop()
    q.put(("timing", index, (max(finished), time.process_time() - cpu0, lag_s)))
    q.put(("rss", index, peak_rss_bytes()))


# -- cluster: children -----------------------------------------------------------------------


def said_summary(messages: Sequence[str], most: int = 4) -> str:
    """What the agents of a process said, by kind (numbers left out), most frequent first."""
    kinds: dict[str, int] = {}
    for message in messages:
        kind = re.sub(r"\d+(\.\d+)?", "#", message.split(": ", 1)[-1])[:240]
        kinds[kind] = kinds.get(kind, 0) + 1
    ranked = sorted(kinds.items(), key=lambda item: -item[1])[:most]
    return "; ".join(f"{count} x {kind!r}" for kind, count in ranked) or "nothing"


def check_table(topology: Any, n: int) -> None:
    """One full check per process (after the clock): rank r is node "r" at data_address(r)."""
    peers = list(topology.peers)
    got = [(p.rank, p.node_id, p.host, p.port) for p in peers]
    want = [(r, str(r), *data_address(r)) for r in range(n)]
    if got != want:
        raise BenchError(f"wrong peer table: {got[:3]}... expected {want[:3]}...")


def cluster_scheduler_main(
    n: int, q: MpQueue[Message], timeout_s: float, ssl_json: str | None = None
) -> None:
    raise_fd_limit()

    async def serve() -> None:
        identity = tls_identity(ssl_json, server=True)
        from cluster.protocol.config import default_heartbeat_interval
        from cluster.scheduler import JobSettings, SchedulerServer
        from cluster.transport import collector

        settings = JobSettings(
            worker_num=n,
            server_num=0,
            node_timeout_s=SIMULATED_NODE_TIMEOUT_S,
            topo_timeout_s=timeout_s,  # the run's own bound: a job that forms in it passes
            # as a real scheduler's
            heartbeat_interval_s=default_heartbeat_interval(SIMULATED_NODE_TIMEOUT_S, n),
        )
        server = SchedulerServer(settings, host=HOST, port=0, tls=identity)
        port = await server.start()
        collector.tune_for_server()  # as the scheduler's own process does (server.serve)
        try:
            q.put(("port", -1, port))
            try:
                ok = await asyncio.wait_for(server.wait_done(), timeout_s)
            except TimeoutError:
                server.core.abort("benchmark timed out")
                ok = False
            core = server.core
            q.put(("done", -1, (ok, core.loop_lag_max_s, core.stalls)))
        finally:
            await server.stop()

    _report_errors(q, -1, lambda: profiled("scheduler", lambda: asyncio.run(serve())))


def profiled(name: str, body: Callable[[], None]) -> None:
    """Run `body`, under cProfile when BENCH_PROFILE_DIR names a directory (the profile is
    written there as `name`.prof): where a process's time goes, for the stages above. When
    BENCH_LOG_DIR names a directory, the process's log (INFO, with times) goes to `name`.log
    there: what the scheduler and the agents decided, and when."""
    logs = os.environ.get("BENCH_LOG_DIR")
    if logs:
        logging.basicConfig(
            filename=str(Path(logs) / f"{name}.log"),
            level=logging.INFO,
            format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s",
            datefmt="%H:%M:%S",
            force=True,
        )
    directory = os.environ.get("BENCH_PROFILE_DIR")
    if not directory:
        body()
        return
    import cProfile

    profile = cProfile.Profile()
    try:
        profile.runcall(body)
    finally:
        profile.dump_stats(str(Path(directory) / f"{name}.prof"))


@dataclass(frozen=True)
class Clients:
    """One client process's part: its index, the worker ids it simulates of `n`, the server's
    port, the run's signals and queue, its bound and (cluster, gRPC) TLS configuration."""

    index: int
    ids: list[int]
    n: int
    port: int
    start: MpEvent
    proceed: MpEvent
    q: MpQueue[Message]
    timeout_s: float
    ssl_json: str | None = None
    relay: str | None = None  # CLUSTER_RELAY of its workers (None: direct)


def cluster_clients_main(c: Clients) -> None:
    index, ids, n, port, start, proceed, q = c.index, c.ids, c.n, c.port, c.start, c.proceed, c.q
    timeout_s, ssl_json = c.timeout_s, c.ssl_json
    raise_fd_limit()
    lower_priority()
    if ssl_json:
        os.environ["CLUSTER_TLS_CONFIG"] = ssl_json

    async def run() -> None:
        import grpc

        from cluster.protocol import environment as cluster_config
        from cluster.protocol.errors import ClusterError
        from cluster.transport.channel import SchedulerProbe
        from cluster.worker.agent import WorkerAgent
        from cluster.worker.identity import NodeIdentity, new_incarnation

        # The simulated workers of this process share their checks of the scheduler.
        probe = SchedulerProbe()
        # Initialise grpc.aio on this loop (its poller) before the clock starts.
        warm = grpc.aio.insecure_channel(f"{HOST}:{port}")
        await warm.close(grace=None)
        messages: list[str] = []
        fatal: list[ClusterError] = []
        agents: list[WorkerAgent] = []
        # Per worker, wall-clock times of its stages: connected, accepted, topology.
        stages: list[tuple[float, float, float]] = []
        wall = time.time() - time.monotonic()  # the agents' clock (monotonic) -> wall time

        async def connected(channel: grpc.aio.Channel) -> float:
            await channel.channel_ready()
            return time.time()

        async def one(i: int) -> float:
            config = cluster_config.from_env(
                {
                    "MS_ROLE": "MS_WORKER",
                    "MS_WORKER_NUM": str(n),
                    "MS_SCHED_HOST": HOST,
                    "MS_SCHED_PORT": str(port),
                    "MS_NODE_ID": str(i),
                    "MS_TOPO_TIMEOUT": str(timeout_s),
                    "MS_NODE_TIMEOUT": str(SIMULATED_NODE_TIMEOUT_S),
                    **({"CLUSTER_TLS_CONFIG": ssl_json} if ssl_json else {}),
                    **({"CLUSTER_RELAY": c.relay} if c.relay else {}),
                }
            )
            data_host, data_port = data_address(i)
            identity = NodeIdentity(
                node_id=str(i), incarnation=new_incarnation(), host=data_host, port=data_port
            )
            agent = WorkerAgent(
                config,
                identity,
                say=lambda message: messages.append(f"worker {i}: {message}"),
                on_fatal=fatal.append,
                probe=probe,
            )
            agents.append(agent)
            connect = asyncio.ensure_future(connected(agent._link.channel))
            topology = await agent.start()
            done = time.time()
            if topology.size != n:
                raise BenchError(f"worker {i} got a table of {topology.size} peers, expected {n}")
            accepted = done if agent.accepted_at is None else agent.accepted_at + wall
            stages.append((await connect, accepted, done))
            return done

        try:
            try:
                await timed(index, ids, one, start, q, timeout_s)
            except (ClusterError, TimeoutError) as exc:
                what = str(exc) or f"not formed within {timeout_s:g} s"
                raise BenchError(f"{what}; the agents said: {said_summary(messages)}") from None
            check_table(agents[0].topology, n)
            q.put(("stages", index, stages))
            if not await signalled(proceed, timeout_s):
                raise BenchError("no signal to finish")
            finish0 = time.time()
            try:
                heard = await asyncio.wait_for(
                    asyncio.gather(*(a.finish() for a in agents)), agents[0].finish_bound_s + 5.0
                )
            except TimeoutError:
                said = said_summary(messages)
                raise BenchError(f"the finish was not heard; the agents said: {said}") from None
            q.put(("finished", index, (time.time() - finish0, heard.count(False))))
        finally:
            await asyncio.wait_for(
                asyncio.gather(*(a.close() for a in agents), return_exceptions=True), 30.0
            )
        if fatal:
            raise BenchError(
                f"{len(fatal)} agent(s) failed, first: {fatal[0]}; what agents said: {messages[:3]}"
            )
        q.put(("closed", index, messages))

    _report_errors(q, index, lambda: profiled(f"clients-{index}", lambda: asyncio.run(run())))


def relay_main(
    k: int,
    port: int,
    n: int,
    address: str,
    q: MpQueue[Message],
    stop: MpEvent,
    timing: tuple[float, float | None] = (SIMULATED_NODE_TIMEOUT_S, None),
) -> None:
    """Relay `k`, serving at `address` (unix:PATH) for the scheduler at `port`, until `stop`.
    `timing`: the relay's MS_NODE_TIMEOUT, and how long it waits for `stop` at most (None: long
    enough for `n` workers to form)."""
    raise_fd_limit()
    lower_priority()
    node_timeout_s, hold_s = timing
    if hold_s is None:
        hold_s = 4 * SPAWN_TIMEOUT_S + MIN_TIMEOUT_S + n * TIMEOUT_PER_NODE_S

    async def serve() -> None:
        from cluster.tools.relay import Relay, RelaySettings
        from cluster.transport import collector

        relay = Relay(RelaySettings(address, f"{HOST}:{port}", n, node_timeout_s))
        await relay.start()
        collector.tune_for_server()  # as `mscluster relay` does
        try:
            q.put(("relay-ready", k, os.getpid()))
            await signalled(stop, hold_s)
        finally:
            await relay.stop()

    _report_errors(q, k, lambda: profiled(f"relay-{k}", lambda: asyncio.run(serve())))


class ConnectionPeak:
    """The most TCP connections process `pid` held at once, sampled from /proc every `every_s`
    on a thread of this process (and whenever `sample` is called)."""

    def __init__(self, pid: int | None, every_s: float = 1.0) -> None:
        self.pid = pid
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def sample(self) -> None:
        from cluster.scheduler.descriptors import connections

        if self.pid is not None:
            count = len(connections(pid=self.pid))
            self.peak = count if self.peak is None else max(self.peak, count)

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.sample()

    def stop(self) -> int | None:
        self._stop.set()
        self._thread.join(10.0)
        self.sample()
        return self.peak


# -- gRPC floor: children -------------------------------------------------------------------


def grpc_floor_server_main(
    n: int, q: MpQueue[Message], stop: MpEvent, timeout_s: float, ssl_json: str | None = None
) -> None:
    raise_fd_limit()

    async def serve() -> None:
        identity = tls_identity(ssl_json, server=True)
        import grpc
        from grpc_health.v1 import health, health_pb2_grpc

        from cluster.transport import collector
        from cluster.transport.server_tls import server_credentials
        from cluster.transport.serving import server_options

        # The scheduler's server options: gRPC's defaults cancel calls at random once 1,000 wait
        # to be taken up, which failed this floor from 2,048 workers on.
        server = grpc.aio.server(options=server_options(n, SIMULATED_NODE_TIMEOUT_S))
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        where = f"{HOST}:0"
        if identity is None:
            port = server.add_insecure_port(where)
        else:
            port = server.add_secure_port(where, server_credentials(identity))
        await server.start()
        collector.tune_for_server()  # tuned as the scheduler is: the floor is no higher
        try:
            q.put(("port", -1, port))
            await signalled(stop, SPAWN_TIMEOUT_S + 2 * timeout_s)
        finally:
            await server.stop(None)

    _report_errors(q, -1, lambda: asyncio.run(serve()))


def grpc_floor_clients_main(c: Clients) -> None:
    index, ids, n, port, start, proceed, q = c.index, c.ids, c.n, c.port, c.start, c.proceed, c.q
    timeout_s, ssl_json = c.timeout_s, c.ssl_json
    raise_fd_limit()
    lower_priority()

    async def run() -> None:
        identity = tls_identity(ssl_json, server=False)
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from cluster.transport.channel import open_channel
        from cluster.worker.scheduler_link import channel_options

        warm = grpc.aio.insecure_channel(f"{HOST}:{port}")
        await warm.close(grace=None)
        channels: list[grpc.aio.Channel] = []

        async def one(i: int) -> float:
            channel = open_channel(
                f"{HOST}:{port}", identity, channel_options(n, SIMULATED_NODE_TIMEOUT_S)
            )
            channels.append(channel)
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), wait_for_ready=True
            )
            return time.time()

        try:
            await timed(index, ids, one, start, q, timeout_s)
            if not await signalled(proceed, timeout_s):
                raise BenchError("no signal to finish")
        finally:
            await asyncio.gather(*(c.close(grace=None) for c in channels))
        q.put(("closed", index, []))

    _report_errors(q, index, lambda: asyncio.run(run()))


# -- TCPStore: children ----------------------------------------------------------------------


def tcpstore_server_main(n: int, q: MpQueue[Message], stop: MpEvent, timeout_s: float) -> None:
    raise_fd_limit()

    def body() -> None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        store = TCPStore(
            HOST,
            0,
            world_size=n,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        q.put(("port", -1, int(store.port)))
        stop.wait(SPAWN_TIMEOUT_S + 2 * timeout_s)
        del store

    _report_errors(q, -1, body)


def tcpstore_clients_main(c: Clients) -> None:
    index, ids, n, port, start, proceed, q = c.index, c.ids, c.n, c.port, c.start, c.proceed, c.q
    timeout_s = c.timeout_s
    raise_fd_limit()
    lower_priority()

    def body() -> None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        keys = [f"addr/{j}" for j in range(n)]
        timeout = datetime.timedelta(seconds=timeout_s)
        go = threading.Event()
        finished: dict[int, float] = {}
        errors: list[str] = []
        stores: list[Any] = []
        lock = threading.Lock()

        def worker(i: int) -> None:
            try:
                if not go.wait(SPAWN_TIMEOUT_S + timeout_s):
                    return
                store = TCPStore(
                    HOST,
                    port,
                    world_size=n,
                    is_master=False,
                    wait_for_workers=False,
                    timeout=timeout,
                )
                store.set(f"addr/{i}", "{}:{}".format(*data_address(i)))
                if store.add("count", 1) == n:
                    store.set("done", "1")
                store.wait(["done"])
                values = store.multi_get(keys)
                done = time.time()
                if len(values) != n:
                    raise BenchError(f"worker {i} got {len(values)} addresses, expected {n}")
                if i == ids[0]:  # one full check per process
                    want = ["{}:{}".format(*data_address(j)).encode() for j in range(n)]
                    if list(values) != want:
                        raise BenchError(f"worker {i} got wrong addresses")
                with lock:
                    finished[i] = done
                    stores.append(store)
            except Exception as exc:
                with lock:
                    errors.append(f"worker {i}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in ids]
        for thread in threads:
            thread.start()
        q.put(("ready", index, None))
        if not start.wait(SPAWN_TIMEOUT_S + timeout_s):
            raise BenchError("no start signal")
        cpu0 = time.process_time()
        go.set()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.1))
        if errors:
            raise BenchError(f"{len(errors)} worker(s) failed, first: {errors[0]}")
        if len(finished) != len(ids):
            raise BenchError(f"only {len(finished)} of {len(ids)} workers finished in time")
        # Threads, not an event loop: no loop lag to report.
        q.put(("timing", index, (max(finished.values()), time.process_time() - cpu0, None)))
        if not proceed.wait(timeout_s):
            raise BenchError("no signal to finish")
        stores.clear()
        q.put(("closed", index, []))

    _report_errors(q, index, body)


# -- one run ---------------------------------------------------------------------------------


def run_once(
    ctx: SpawnContext,
    system: str,
    n: int,
    procs: int,
    timeout_s: float,
    ssl_json: str | None = None,
    relays: int = 0,
) -> dict[str, float | None]:
    """One rendezvous of `n` workers: seconds from the start signal to the last full table, and
    the CPU seconds the client processes (sum) and the server process used meanwhile; for
    cluster-relays, through `relays` relay processes."""
    relays = relays if system == "cluster-relays" else 0
    procs = min(max(procs, relays), n)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S + timeout_s
    q: MpQueue[Message] = ctx.Queue()
    start = ctx.Event()
    proceed = ctx.Event()
    stop = ctx.Event()
    sockets = tempfile.TemporaryDirectory(prefix="rdv-")
    with sockets, children(ctx) as group:
        box = Mailbox(q, group)
        tls_json: str | None = None
        if system.startswith("cluster"):
            server = group.spawn(
                cluster_scheduler_main, n, q, timeout_s, ssl_json, name="scheduler"
            )
            client_main: Callable[[Clients], None] = cluster_clients_main
            tls_json = ssl_json
        elif system.startswith("grpc"):
            server = group.spawn(
                grpc_floor_server_main, n, q, stop, timeout_s, ssl_json, name="grpc-server"
            )
            client_main = grpc_floor_clients_main
            tls_json = ssl_json
        else:
            server = group.spawn(
                tcpstore_server_main, n, q, stop, timeout_s, name="tcpstore-server"
            )
            client_main = tcpstore_clients_main
        port = box.collect("port", 1, time.monotonic() + SPAWN_TIMEOUT_S)[-1]
        addresses = [f"unix:{sockets.name}/relay-{k}.sock" for k in range(relays)]
        for k, address in enumerate(addresses):
            group.spawn(relay_main, k, port, n, address, q, stop, name=f"relay-{k}")
        relay_pids = list(
            box.collect("relay-ready", relays, time.monotonic() + SPAWN_TIMEOUT_S).values()
        )
        for k, ids in enumerate(split(range(n), procs)):
            relay = addresses[k * relays // procs] if relays else None
            clients = Clients(k, list(ids), n, port, start, proceed, q, timeout_s, tls_json, relay)
            group.spawn(client_main, clients, name=f"clients-{k}")
        box.collect("ready", procs, time.monotonic() + SPAWN_TIMEOUT_S)
        server_cpu0, server_rss0 = cpu_seconds(server.pid), rss_bytes(server.pid)
        relay_cpu0 = [cpu_seconds(pid) or 0.0 for pid in relay_pids]
        peak = ConnectionPeak(server.pid) if system.startswith("cluster") else None
        t0 = time.time()
        start.set()
        timings = box.collect("timing", procs, deadline)
        server_cpu1, server_rss1 = cpu_seconds(server.pid), rss_bytes(server.pid)
        relay_cpu1 = [cpu_seconds(pid) or 0.0 for pid in relay_pids]
        result: dict[str, float | None] = {
            "relay_cpu_s": sum(relay_cpu1) - sum(relay_cpu0) if relays else None,
            "scheduler_connections_peak": None if peak is None else peak.stop(),
            "elapsed_s": max(end for end, _, _ in timings.values()) - t0,
            "client_cpu_s": sum(cpu for _, cpu, _ in timings.values()),
            "client_lag_max_s": max(
                (lag for _, _, lag in timings.values() if lag is not None), default=None
            ),
            "server_cpu_s": None
            if server_cpu0 is None or server_cpu1 is None
            else server_cpu1 - server_cpu0,
            "server_rss_per_node_b": None
            if server_rss0 is None or server_rss1 is None
            else (server_rss1 - server_rss0) / n,
        }
        if system.startswith(("cluster", "grpc")):
            peaks = box.collect("rss", procs, deadline).values()
            result["client_peak_rss_per_node_b"] = sum(peaks) / n
        if system.startswith("cluster"):
            result.update(stage_figures(box.collect("stages", procs, deadline), t0))
        # Said now: a finish storm that fails the run later leaves the formation measured.
        print(
            f"  N={n} {system}: formed in {result['elapsed_s']:.1f} s (the finish follows)",
            flush=True,
        )
        proceed.set()
        # The agents wait for their finish's answer for up to finish_bound_s (the node timeout
        # and its slack), then close (at most 30 s): a slow finish storm is not a failure.
        from cluster.worker.machine.pacing import FINISH_SLACK_S

        closing = time.monotonic() + SIMULATED_NODE_TIMEOUT_S + 2 * FINISH_SLACK_S + 60.0
        said = [m for ms in box.collect("closed", procs, closing).values() for m in ms]
        if system.startswith("cluster"):
            finished = box.collect("finished", procs, closing).values()
            result["finish_s"] = max(seconds for seconds, _ in finished)
            unheard = sum(count for _, count in finished)
            ok, lag_s, stalls = box.collect("done", 1, time.monotonic() + 60.0)[-1]
            result["server_lag_max_s"], result["server_stalls"] = lag_s, stalls
            if not ok or unheard:
                raise BenchError(
                    f"the scheduler did not see every worker finish ({unheard} finish(es) "
                    f"unheard); the agents said: {said_summary(said, most=6)}"
                )
        stop.set()
        group.join_all(time.monotonic() + JOIN_TIMEOUT_S)
    return result


def stage_figures(
    per_process: dict[int, list[tuple[float, float, float]]], t0: float
) -> dict[str, float | None]:
    """The median and the last of each stage over every worker, in seconds after `t0`."""
    figures: dict[str, float | None] = {}
    rows = [row for rows in per_process.values() for row in rows]
    for k, stage in enumerate(("connected", "accepted", "topology")):
        times = [row[k] - t0 for row in rows]
        figures[f"{stage}_p50_s"] = statistics.median(times) if times else None
        figures[f"{stage}_max_s"] = max(times) if times else None
    return figures


# -- real processes --------------------------------------------------------------------------


def real_worker_main(i: int, env: dict[str, str], q: MpQueue[Message]) -> None:
    def body() -> None:
        os.environ.update(env)
        import cluster

        # `import cluster` alone does not import grpc (init() does, for TLS's sake): import what
        # init() will, so that "started" is taken with grpc loaded, as the brief defines it.
        importlib.import_module("grpc")
        importlib.import_module("cluster.worker.session")
        started = time.time()
        q.put(("started", i, started))
        cluster.init()
        returned = time.time()
        size = cluster.get_group_size()
        q.put(("returned", i, (returned, size)))
        cluster.finalize()

    _report_errors(q, i, body)


def run_real_once(ctx: SpawnContext, n: int, timeout_s: float) -> dict[str, float]:
    q: MpQueue[Message] = ctx.Queue()
    with children(ctx) as group:
        box = Mailbox(q, group)
        group.spawn(cluster_scheduler_main, n, q, timeout_s, name="scheduler")
        port = box.collect("port", 1, time.monotonic() + SPAWN_TIMEOUT_S)[-1]
        env = {
            "MS_ROLE": "MS_WORKER",
            "MS_WORKER_NUM": str(n),
            "MS_SCHED_HOST": HOST,
            "MS_SCHED_PORT": str(port),
            "MS_TOPO_TIMEOUT": "120",
            "MS_NODE_TIMEOUT": "30",
        }
        for i in range(n):
            group.spawn(real_worker_main, i, {**env, "MS_NODE_ID": str(i)}, q, name=f"worker-{i}")
        deadline = time.monotonic() + SPAWN_TIMEOUT_S + timeout_s
        started: dict[int, float] = box.collect("started", n, deadline)
        returned: dict[int, float] = {}
        for i, (when, size) in box.collect("returned", n, deadline).items():
            if size != n:
                raise BenchError(f"real worker {i} sees a job of {size}, expected {n}")
            returned[i] = when
        ok = box.collect("done", 1, time.monotonic() + 60.0)[-1]
        if not ok:
            raise BenchError("real job: the scheduler did not see every worker finish")
        group.join_all(time.monotonic() + JOIN_TIMEOUT_S)
    return {
        "last_start_to_last_init": max(returned.values()) - max(started.values()),
        "first_start_to_last_init": max(returned.values()) - min(started.values()),
    }


def use_tcp_resolver() -> None:
    """RES_OPTIONS=use-vc for this process and the ones it spawns (see the module's text)."""
    # Inherited by every spawned process; glibc reads it when its resolver first runs.
    opts = os.environ.get("RES_OPTIONS", "")
    if "use-vc" not in opts.split():
        os.environ["RES_OPTIONS"] = f"{opts} use-vc".strip()
    # One "hostname of the client socket cannot be retrieved" warning per TCPStore client.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


# -- main ------------------------------------------------------------------------------------


def torch_version() -> str | None:
    try:
        import torch
        import torch.distributed
    except ImportError:
        return None
    return str(torch.__version__)


def stages_line(run: dict[str, float | None]) -> str:
    """A cluster run's stages (median / last worker, after the start signal) and lags."""
    parts = [
        f"{stage} {fmt_s(run.get(f'{stage}_p50_s'))}/{fmt_s(run.get(f'{stage}_max_s'))}"
        for stage in ("connected", "accepted", "topology")
    ]
    peak = run.get("scheduler_connections_peak")
    return (
        ", ".join(parts)
        + f"; finish {fmt_s(run.get('finish_s'))}; loop lag: scheduler "
        + f"{fmt_s(run.get('server_lag_max_s'))}, clients {fmt_s(run.get('client_lag_max_s'))}"
        + ("" if peak is None else f"; scheduler connections: peak {peak:.0f}")
    )


def print_per_node(results: dict[str, Any], sizes: Sequence[int], systems: Sequence[str]) -> None:
    """Per size and system (medians): wall time, server CPU, server RSS per node (the growth
    from before the workers came to when every worker held the table), client CPU per node,
    client processes' peak RSS per node (a simulated worker's share)."""
    print("Per node (median): wall, server CPU, server RSS per node, client CPU and RSS per node")
    header = f"{'N':>6} | {'system':<15} | {'wall':>8} | {'server CPU':>10} | "
    header += f"{'RSS/node':>9} | {'client CPU/node':>15} | {'client RSS/node':>15}"
    print(header)
    print("-" * len(header))
    for n in sizes:
        entry = results["sizes"][str(n)]
        for system in systems:

            def median(key: str, system: str = system, entry: Any = entry) -> float | None:
                value = entry.get(f"{system}_median_{key}")
                return None if value is None else float(value)

            rss, client = median("server_rss_per_node_b"), median("client_cpu_s")
            peak = median("client_peak_rss_per_node_b")
            print(
                f"{n:>6} | {system:<15} | {fmt_s(median('elapsed_s')):>8} | "
                f"{fmt_s(median('server_cpu_s')):>10} | "
                f"{'-' if rss is None else f'{rss / 1024:.1f} KiB':>9} | "
                f"{'-' if client is None else f'{client / n * 1e6:.0f} us':>15} | "
                f"{'-' if peak is None else f'{peak / 1024:.0f} KiB':>15}"
            )
    if "cluster" in systems:
        print()
        print("cluster's stages (median): seconds after the start signal, median / last worker")
        for n in sizes:
            entry = results["sizes"][str(n)]
            run = {
                key.removeprefix("cluster_median_"): value
                for key, value in entry.items()
                if key.startswith("cluster_median_")
            }
            print(f"{n:>6} | {stages_line(run)}")


def print_relays(results: dict[str, Any], sizes: Sequence[int], relays: int) -> None:
    """Direct (cluster) against `relays` relays (cluster-relays), medians: wall time, the
    scheduler's CPU, the relays' CPU, and the scheduler's peak connection count."""
    print()
    print(f"Through {relays} relays (cluster-relays) and direct (cluster), medians:")
    header = (
        f"{'N':>6} | {'direct':>8} | {'relays':>8} | {'ratio':>5} | {'sched CPU d/r':>17} | "
        f"{'relays CPU':>10} | {'sched conns d/r':>15}"
    )
    print(header)
    print("-" * len(header))
    for n in sizes:
        entry = results["sizes"][str(n)]

        def get(system: str, key: str, entry: Any = entry) -> Any:
            return entry.get(f"{system}_median_{key}")

        direct, relayed = get("cluster", "elapsed_s"), get("cluster-relays", "elapsed_s")
        ratio = f"{relayed / direct:.2f}" if direct and relayed else "-"
        cpu = "/".join(fmt_s(get(s, "server_cpu_s")) for s in ("cluster", "cluster-relays"))
        peaks = [get(s, "scheduler_connections_peak") for s in ("cluster", "cluster-relays")]
        conns = "/".join("-" if v is None else f"{v:.0f}" for v in peaks)
        print(
            f"{n:>6} | {fmt_s(direct):>8} | {fmt_s(relayed):>8} | {ratio:>5} | {cpu:>17} | "
            f"{fmt_s(get('cluster-relays', 'relay_cpu_s')):>10} | {conns:>15}"
        )


def timeout_for(given: float | None, n: int) -> float:
    """A run's bound: `given`, else MIN_TIMEOUT_S, or TIMEOUT_PER_NODE_S a worker when longer."""
    return given if given is not None else max(MIN_TIMEOUT_S, n * TIMEOUT_PER_NODE_S)


def fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="8,64,256,1024", help="comma-separated worker counts")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size (median reported)")
    parser.add_argument(
        "--procs",
        default="auto",
        help="client processes per run; auto: one per AGENTS_PER_PROCESS workers, at least 4",
    )
    parser.add_argument(
        "--real", type=int, default=8, help="workers of the real-process job (0: skip)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per run, at most (default: MIN_TIMEOUT_S, or TIMEOUT_PER_NODE_S a worker "
        "when longer: TCPStore took 100 s at 4,096)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="a failed run is reported and run again, at most this many times per run",
    )
    parser.add_argument(
        "--systems",
        default="cluster,tcpstore,grpc",
        help="comma-separated: cluster, tcpstore (skipped when torch is not importable), "
        "cluster-tls (mutual TLS, no CRL), cluster-tls-crl (mutual TLS with a CRL), "
        "grpc and grpc-tls (gRPC's floor: one connection and one empty call per worker)",
    )
    parser.add_argument(
        "--resolver",
        choices=("tcp", "system"),
        default="tcp",
        help="tcp: RES_OPTIONS=use-vc in every process (see above); system: as configured",
    )
    parser.add_argument(
        "--relays",
        type=int,
        default=0,
        help="K: also run cluster-relays, the workers through K relay processes (0: not)",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="N: the client and relay processes run at niceness N, the scheduler (or a "
        "floor's server) at the parent's: on a real cluster the scheduler has a machine of its "
        "own, where here 64 relays and 64 client processes share 2 cores with it (0: all alike)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: comma-separated integers expected")
    if not args.sizes or min(args.sizes) < 1:
        parser.error("--sizes: worker counts must be >= 1")
    if args.procs != "auto":
        try:
            args.procs = int(args.procs)
        except ValueError:
            parser.error(f"--procs {args.procs!r}: an integer or 'auto' expected")
    bad_procs = args.procs != "auto" and args.procs < 1
    if (
        args.repeat < 1
        or bad_procs
        or args.real < 0
        or (args.timeout is not None and args.timeout <= 0)
    ):
        parser.error("--repeat and --procs must be >= 1, --real >= 0, --timeout > 0")
    if args.retries < 0:
        parser.error("--retries must be >= 0")
    args.systems = systems_with_relays(parser, args.systems, args.relays)
    known = ("cluster", "tcpstore", "cluster-relays", *TLS_SYSTEMS, *FLOOR_SYSTEMS)
    unknown = set(args.systems) - set(known)
    if unknown or not args.systems:
        parser.error(f"--systems: choose among {', '.join(known)} (got {args.systems})")
    return args


# Simulated workers per client process with --procs auto. Each process runs its agents on one
# asyncio loop: 2,048 agents on one loop made that loop the bottleneck of the run (late reads
# of the scheduler's answers, a lag of seconds), while more processes than this on 2 cores only
# add switches between them.
AGENTS_PER_PROCESS = 1024
MIN_PROCS = 4


def procs_for(procs: int | str, n: int) -> int:
    """Client processes for a run of `n` workers (`procs`: a number, or "auto")."""
    if procs == "auto":
        return min(n, max(MIN_PROCS, -(-n // AGENTS_PER_PROCESS)))
    return min(int(procs), n)


def systems_with_relays(parser: argparse.ArgumentParser, systems: str, relays: int) -> list[str]:
    """`--systems` as a list, with cluster-relays added when `--relays K` asks for it (the
    parser's error for a bad pair)."""
    chosen = [s.strip() for s in systems.split(",") if s.strip()]
    if relays < 0:
        parser.error("--relays must be >= 0")
    if relays and "cluster-relays" not in chosen:
        chosen.append("cluster-relays")
    if "cluster-relays" in chosen and not relays:
        parser.error("--systems cluster-relays needs --relays K (K >= 1)")
    return chosen


def check_open_files(
    limit: int, sizes: Sequence[int], procs: int | str, systems: Sequence[str], relays: int
) -> None:
    """A run needs a descriptor per connection in the server and in each client process; behind
    relays only (`--systems cluster-relays`), one per worker in its relay, one per relay in the
    scheduler."""
    relays_only = list(systems) == ["cluster-relays"]
    need = (
        max(
            max(
                -(-n // relays) if relays_only else n,
                -(-n // max(procs_for(procs, n), relays if relays_only else 1)),
            )
            for n in sizes
        )
        + 512
    )
    if limit < need:
        raise BenchError(
            f"the open-files limit is {limit}, and the largest run needs about {need}: raise it "
            f"(ulimit -n {need} in this shell; as root the benchmark raises it itself) or run "
            "smaller sizes"
        )


def with_retries(
    what: str, retries: int, failures: list[dict[str, str]], attempt: Callable[[], T]
) -> T:
    """Run `attempt`; a failure is printed, recorded and retried up to `retries` times."""
    for k in range(retries + 1):
        try:
            return attempt()
        except BenchError as exc:
            failures.append({"run": what, "error": str(exc)})
            print(f"  {what}: FAILED ({exc})", flush=True)
            if k == retries:
                raise
    raise AssertionError("unreachable")


TLS_SYSTEMS = ("cluster-tls", "cluster-tls-crl")
FLOOR_SYSTEMS = ("grpc", "grpc-tls")


def make_tls_configs(directory: Path) -> dict[str, str]:
    """A test PKI (cluster.certs) and one ssl.json per TLS system: without and with the CRL."""
    from cluster.transport import certs

    pki = certs.make_pki(directory)
    with_crl = json.loads(pki.ssl_json.read_text())
    without = {**with_crl, "crl_path": ""}
    plain = directory / "ssl-no-crl.json"
    plain.write_text(json.dumps(without))
    return {"cluster-tls": str(plain), "cluster-tls-crl": str(pki.ssl_json), "grpc-tls": str(plain)}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tls_dir = Path(tempfile.mkdtemp(prefix="rendezvous-tls-"))
    ssl_jsons = make_tls_configs(tls_dir) if set(args.systems) & {*TLS_SYSTEMS, "grpc-tls"} else {}
    check_open_files(raise_fd_limit(), args.sizes, args.procs, args.systems, args.relays)
    os.environ["BENCH_CLIENT_NICE"] = str(args.nice)  # the spawned processes read it
    if args.resolver == "tcp":
        use_tcp_resolver()
    ctx = mp.get_context("spawn")
    tv = torch_version() if "tcpstore" in args.systems else None
    systems = [s for s in args.systems if s != "tcpstore" or tv]
    print(
        f"rendezvous: sizes={args.sizes} repeat={args.repeat} procs={args.procs} "
        f"cpus={os.cpu_count()} python={platform.python_version()} "
        f"torch={tv or 'not used'} resolver={args.resolver} clients' nice={args.nice}",
        flush=True,
    )
    failures: list[dict[str, str]] = []
    results: dict[str, Any] = {
        "sizes": {},
        "repeat": args.repeat,
        "procs": args.procs,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": tv,
        "resolver": args.resolver,
        "failures": failures,
    }
    for n in args.sizes:
        runs: dict[str, list[dict[str, float | None]]] = {s: [] for s in systems}
        for r in range(args.repeat):
            for system in systems:
                what = f"N={n:<5} run {r + 1}/{args.repeat} {system:<8}"
                run = with_retries(
                    what,
                    args.retries,
                    failures,
                    functools.partial(
                        run_once,
                        ctx,
                        system,
                        n,
                        procs_for(args.procs, n),
                        timeout_for(args.timeout, n),
                        ssl_jsons.get(system),
                        args.relays,
                    ),
                )
                runs[system].append(run)
                print(
                    f"  {what} {fmt_s(run['elapsed_s']):>8}   CPU meanwhile: clients "
                    f"{fmt_s(run['client_cpu_s'])}, server {fmt_s(run['server_cpu_s'])}"
                    + (f", relays {fmt_s(run['relay_cpu_s'])}" if run.get("relay_cpu_s") else "")
                    + (f"; {stages_line(run)}" if system.startswith("cluster") else ""),
                    flush=True,
                )
        entry: dict[str, Any] = {"runs": runs, "procs": procs_for(args.procs, n)}
        for system in systems:
            for key in sorted({key for run in runs[system] for key in run}):
                values = [v for v in (run[key] for run in runs[system]) if v is not None]
                median_key = f"{system}_median_{key}"
                entry[median_key] = statistics.median(values) if values else None
        results["sizes"][str(n)] = entry

    real: dict[str, Any] | None = None
    if args.real:
        samples: list[dict[str, float]] = []
        for r in range(args.repeat):
            what = f"real job of {args.real} processes, run {r + 1}/{args.repeat}"
            sample = with_retries(
                what,
                args.retries,
                failures,
                functools.partial(
                    run_real_once, ctx, args.real, timeout_for(args.timeout, args.real)
                ),
            )
            samples.append(sample)
            print(f"  {what}: {fmt_s(sample['last_start_to_last_init'])}", flush=True)
        real = {
            "workers": args.real,
            "runs": samples,
            "last_start_to_last_init_median_s": statistics.median(
                s["last_start_to_last_init"] for s in samples
            ),
            "first_start_to_last_init_median_s": statistics.median(
                s["first_start_to_last_init"] for s in samples
            ),
        }
        results["real"] = real

    print()
    print_per_node(results, args.sizes, systems)
    print()
    print(
        f"Median of {args.repeat} run(s); client processes: "
        + ", ".join(f"{procs_for(args.procs, n)} at N={n}" for n in args.sizes)
        + "; wall time from the start signal to the last worker holding the full peer table."
    )
    header = f"{'N':>6} | {'cluster':>10} | {'TCPStore':>10} | {'TCPStore/cluster':>16}"
    print(header)
    print("-" * len(header))
    for n in args.sizes:
        entry = results["sizes"][str(n)]
        ours = entry.get("cluster_median_elapsed_s")
        peer = entry.get("tcpstore_median_elapsed_s")
        ratio = f"{peer / ours:.2f}" if peer is not None and ours else "-"
        print(f"{n:>6} | {fmt_s(ours):>10} | {fmt_s(peer):>10} | {ratio:>16}")
    print("(ratio > 1: cluster is faster)")
    print()
    print("Median CPU time used during the rendezvous (client processes summed / server process):")
    header = f"{'N':>6} | {'cluster clients':>15} | {'scheduler':>10} | "
    header += f"{'TCPStore clients':>16} | {'TCPStore server':>15}"
    print(header)
    print("-" * len(header))
    for n in args.sizes:
        entry = results["sizes"][str(n)]
        print(
            f"{n:>6} | {fmt_s(entry.get('cluster_median_client_cpu_s')):>15} | "
            f"{fmt_s(entry.get('cluster_median_server_cpu_s')):>10} | "
            f"{fmt_s(entry.get('tcpstore_median_client_cpu_s')):>16} | "
            f"{fmt_s(entry.get('tcpstore_median_server_cpu_s')):>15}"
        )
    tls_systems = [s for s in TLS_SYSTEMS if s in args.systems]
    if tls_systems and "cluster" in args.systems:
        print()
        print("TLS: median wall time, and its ratio to plaintext cluster (target: < 2):")
        header = f"{'N':>6} | {'plaintext':>10} | " + " | ".join(
            f"{s:>15} | {'ratio':>6}" for s in tls_systems
        )
        print(header)
        print("-" * len(header))
        for n in args.sizes:
            entry = results["sizes"][str(n)]
            plain = entry.get("cluster_median_elapsed_s")
            cells = []
            for s in tls_systems:
                secured = entry.get(f"{s}_median_elapsed_s")
                ratio = f"{secured / plain:.2f}" if secured is not None and plain else "-"
                cells.append(f"{fmt_s(secured):>15} | {ratio:>6}")
            print(f"{n:>6} | {fmt_s(plain):>10} | " + " | ".join(cells))
    if set(FLOOR_SYSTEMS) <= set(args.systems):
        print()
        print("gRPC's floor: one connection and one empty call per worker, plaintext and TLS:")
        header = f"{'N':>6} | {'grpc':>10} | {'grpc-tls':>10} | {'ratio':>6}"
        print(header)
        print("-" * len(header))
        for n in args.sizes:
            entry = results["sizes"][str(n)]
            plain = entry.get("grpc_median_elapsed_s")
            secured = entry.get("grpc-tls_median_elapsed_s")
            ratio = f"{secured / plain:.2f}" if secured is not None and plain else "-"
            print(f"{n:>6} | {fmt_s(plain):>10} | {fmt_s(secured):>10} | {ratio:>6}")
    if "cluster-relays" in args.systems:
        print_relays(results, args.sizes, args.relays)
    shutil.rmtree(tls_dir, ignore_errors=True)
    if real is not None:
        print()
        print(
            f"Real job, {real['workers']} worker processes (cluster.init()): last process started "
            f"-> last init() returned: median {fmt_s(real['last_start_to_last_init_median_s'])} "
            f"(runs: {', '.join(fmt_s(s['last_start_to_last_init']) for s in real['runs'])}); "
            f"first started -> last returned: median "
            f"{fmt_s(real['first_start_to_last_init_median_s'])}."
        )
    if failures:
        print()
        print(f"{len(failures)} failed run(s), each run again (see above):")
        for failure in failures:
            print(f"  {failure['run'].strip()}: {failure['error']}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"rendezvous benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
