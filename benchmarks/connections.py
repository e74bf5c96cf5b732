"""Idle connections benchmark: how long a job takes to form while stray sockets hold the port.

A scheduler (`mscluster scheduler`) runs with its open-files limit held to `--files` (soft and
hard, so it cannot raise it, as on a host whose hard limit is low). `--idle` raw TCP connections
that never send a byte (a port scanner, a misconfigured client, an attacker) are opened to it;
then 2 real workers of examples/allgather_check.py start. Measured: from the workers' spawn to
both having exited 0 (joined, gathered, finished), or "did not form" after `--limit` seconds.

`--grpc-defaults` runs the same scheduler without the two server options that drop such
connections (`grpc.server_handshake_timeout_ms`, default 2 minutes in gRPC, and
`grpc.max_connection_idle_ms`, default none), for comparison.

`--stalled N` opens, instead of raw sockets, N calls of `Register` over `--stalled-connections`
connections that send their headers and never their request (the stream stays open, pings are
answered): the scheduler cuts each after its first-message time and turns away a peer's calls
past its share (`cluster.transport.handlers.Arrivals`). `--unbounded` runs the scheduler without
that (no deadline, no share: gRPC holds such a stream for as long as the peer answers pings), for
comparison.

Usage: python benchmarks/connections.py [--files 256] [--idle 0,400,1000] [--repeat 3]
       [--limit 60] [--grpc-defaults] [--stalled N --stalled-connections C --unbounded]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "allgather_check.py"
HOST = "127.0.0.1"
POLL_S = 0.01
# The scheduler, optionally without the options that drop idle connections.
SCHEDULER = """
import sys
from cluster.transport import edge, serving
if sys.argv[1] == "grpc-defaults":
    dropped = ("grpc.server_handshake_timeout_ms", "grpc.max_connection_idle_ms")
    serving.SERVER_OPTIONS[:] = [o for o in serving.SERVER_OPTIONS if o[0] not in dropped]
if sys.argv[1] == "unbounded":
    edge.FIRST_MESSAGE_S = edge.FIRST_LARGE_MESSAGE_S = 10**6
    edge.ARRIVALS_PER_PEER = edge.ARRIVALS_TOTAL = 10**9
from cluster.tools.cli import main
sys.exit(main(["scheduler"]))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def idle_sockets(port: int, count: int) -> Iterator[None]:
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex((HOST, port))
            socks.append(sock)
        yield
    finally:
        for sock in socks:
            sock.close()


@contextlib.contextmanager
def stalled_calls(
    port: int, count: int, connections: int, ready: Callable[[], bool]
) -> Iterator[None]:
    """`count` Register calls over `connections` connections, each sending its headers and
    never its request, held open (from a thread of their own) until the block ends; the block
    starts once `ready()` (the scheduler holds them) or after 120 s."""
    opened, release = threading.Event(), threading.Event()

    async def hold() -> None:
        channels = [
            grpc.aio.insecure_channel(
                f"{HOST}:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
            )
            for _ in range(connections)
        ]
        never = asyncio.Event()

        async def no_request() -> AsyncIterator[bytes]:
            await never.wait()  # the stall: this outsider never sends its request
            yield b""

        calls = [
            channels[i % connections].stream_unary(
                "/cluster.v1.Scheduler/Register",
                request_serializer=lambda raw: raw,
                response_deserializer=lambda raw: raw,
            )(no_request(), timeout=600)
            for i in range(count)
        ]
        done = asyncio.ensure_future(asyncio.gather(*calls, return_exceptions=True))
        deadline = time.monotonic() + 120
        while not ready() and time.monotonic() < deadline:  # noqa: ASYNC110 - polls /proc
            await asyncio.sleep(0.1)  # a benchmark: until the scheduler holds the connections
        opened.set()
        await asyncio.get_running_loop().run_in_executor(None, release.wait)
        never.set()
        done.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await done
        for channel in channels:
            await channel.close(None)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    thread = threading.Thread(target=lambda: asyncio.run(hold()), daemon=True)
    thread.start()
    try:
        opened.wait(150)
        yield
    finally:
        release.set()
        thread.join(60)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_files(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def wait_for(predicate: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def once(
    files: int, idle: int, limit_s: float, mode: str, stalled: tuple[int, int]
) -> float | None:
    """Seconds from the workers' spawn to both exited 0; None when the job did not form."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    env.update(
        MS_WORKER_NUM="2",
        MS_SCHED_HOST=HOST,
        MS_SCHED_PORT=str(port),
        MS_TOPO_TIMEOUT=f"{limit_s:g}",
        PYTHONUNBUFFERED="1",
    )

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    with tempfile.TemporaryDirectory(prefix="cluster-bench-") as tmp:
        log = Path(tmp) / "scheduler.log"
        with log.open("wb") as out:
            scheduler = subprocess.Popen(
                [sys.executable, "-c", SCHEDULER, mode],
                env={**env, "MS_ROLE": "MS_SCHED"},
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=limit_files,  # noqa: PLW1509 - setrlimit only, before exec
            )
        workers: list[subprocess.Popen[bytes]] = []
        try:
            if not wait_for(lambda: "listening on" in log.read_text(), 30):
                raise SystemExit(f"the scheduler did not start:\n{log.read_text()}")
            held = min(stalled[1], files) - 100  # descriptors: one a connection

            def holding() -> bool:
                return open_files(scheduler.pid) >= held

            attack = (
                stalled_calls(port, *stalled, holding) if stalled[0] else idle_sockets(port, idle)
            )
            with attack:
                started = time.monotonic()
                workers = [
                    subprocess.Popen(
                        [sys.executable, str(EXAMPLE)],
                        env={**env, "MS_ROLE": "MS_WORKER"},
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    for _ in range(2)
                ]
                formed = wait_for(lambda: all(w.poll() is not None for w in workers), limit_s + 5)
                took = time.monotonic() - started
            ok = formed and all(w.returncode == 0 for w in workers)
            return took if ok else None
        finally:
            for proc in [*workers, scheduler]:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=256, help="the scheduler's open files")
    parser.add_argument("--idle", default="0,400,1000", help="idle sockets, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--limit", type=float, default=60.0, help="seconds to form, at most")
    parser.add_argument("--grpc-defaults", action="store_true", help="without the two options")
    parser.add_argument("--stalled", type=int, default=0, help="stalled calls, not sockets")
    parser.add_argument("--stalled-connections", type=int, default=100)
    parser.add_argument("--unbounded", action="store_true", help="no first-message deadline")
    args = parser.parse_args(argv)
    mode = "grpc-defaults" if args.grpc_defaults else "cluster"
    mode = "unbounded" if args.unbounded else mode
    what = {"grpc-defaults": "gRPC's defaults", "unbounded": "no first-message deadline"}
    print(f"2-worker job, scheduler held to {args.files} open files, {what.get(mode, mode)}")
    stalled = (args.stalled, args.stalled_connections)
    if args.stalled:
        print(f"{args.stalled} stalled calls over {args.stalled_connections} connections")
        args.idle = "0"
    print(f"{'idle sockets':>12}  {'median':>8}  runs")
    for idle in (int(n) for n in args.idle.split(",")):
        runs = [once(args.files, idle, args.limit, mode, stalled) for _ in range(args.repeat)]
        formed = [r for r in runs if r is not None]
        median = f"{statistics.median(formed):.2f} s" if len(formed) == len(runs) else "-"
        shown = ", ".join("did not form" if r is None else f"{r:.2f}" for r in runs)
        print(f"{idle:>12}  {median:>8}  {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
