"""Idle connections benchmark: how long a job takes to form while stray sockets hold the port.

A scheduler (`mscluster scheduler`) runs with its open-files limit held to `--files` (soft and
hard, so it cannot raise it, as on a host whose hard limit is low). `--idle` raw TCP connections
that never send a byte (a port scanner, a misconfigured client, an attacker) are opened to it;
then 2 real workers of examples/allgather_check.py start. Measured: from the workers' spawn to
both having exited 0 (joined, gathered, finished), or "did not form" after `--limit` seconds.

`--grpc-defaults` runs the same scheduler without the two server options that drop such
connections (`grpc.server_handshake_timeout_ms`, default 2 minutes in gRPC, and
`grpc.max_connection_idle_ms`, default none), for comparison.

Usage: python benchmarks/connections.py [--files 256] [--idle 0,400,1000] [--repeat 3]
       [--limit 60] [--grpc-defaults]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "allgather_check.py"
HOST = "127.0.0.1"
POLL_S = 0.01
# The scheduler, optionally without the options that drop idle connections.
SCHEDULER = """
import sys
from cluster.scheduler import server
if sys.argv[1] == "grpc-defaults":
    dropped = ("grpc.server_handshake_timeout_ms", "grpc.max_connection_idle_ms")
    server.SERVER_OPTIONS[:] = [o for o in server.SERVER_OPTIONS if o[0] not in dropped]
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


def wait_for(predicate: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def once(files: int, idle: int, limit_s: float, grpc_defaults: bool) -> float | None:
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
        mode = "grpc-defaults" if grpc_defaults else "cluster"
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
            with idle_sockets(port, idle):
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
    args = parser.parse_args(argv)
    what = "gRPC's defaults" if args.grpc_defaults else "cluster's server options"
    print(f"2-worker job, scheduler held to {args.files} open files, {what}")
    print(f"{'idle sockets':>12}  {'median':>8}  runs")
    for idle in (int(n) for n in args.idle.split(",")):
        runs = [once(args.files, idle, args.limit, args.grpc_defaults) for _ in range(args.repeat)]
        formed = [r for r in runs if r is not None]
        median = f"{statistics.median(formed):.2f} s" if len(formed) == len(runs) else "-"
        shown = ", ".join("did not form" if r is None else f"{r:.2f}" for r in runs)
        print(f"{idle:>12}  {median:>8}  {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
