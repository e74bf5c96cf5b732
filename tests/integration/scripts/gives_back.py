"""A worker that joins three jobs, one after the other, in one process (its first argument is a
directory: it joins job N once `job-N` exists there). After each of the first two finalizes it
says what it holds that it did not hold before its first init(): the closed session (is it
collected?), threads, file descriptors, registrations of the finalize at exit, the `sys.exit`
wrapper and GRPC_ENABLE_FORK_SUPPORT. In the first job it asks `sys.exit(1)` and catches it; the
third job ends at exit, where the scheduler is told how this process ended."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import weakref
from pathlib import Path

import cluster
from cluster.api import runtime
from cluster.protocol.errors import ClusterError
from cluster.testing import wait_until

BOUND_S = 60.0
SETTLE_S = 10.0  # well within the test's wait for what this says
here = Path(sys.argv[1])
# The launcher watch stays, one for the process (`cluster.worker.orphan`).
KEPT = ["cluster-launcher-watch"] if "CLUSTER_LAUNCHER_PID" in os.environ else []


def descriptors() -> set[tuple[str, str]]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own is gone
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return found


def threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())


def registered() -> int:
    """How many times the finalize at exit is registered (atexit holds a reference each)."""
    return sys.getrefcount(runtime._finalize_at_exit)


before = (descriptors(), registered(), sys.exit)


def job(n: int) -> weakref.ref[object]:
    wait_until((here / f"job-{n}").exists, BOUND_S, f"job {n}'s scheduler")
    cluster.init()
    session = weakref.ref(runtime.session())
    cluster.barrier()
    return session


def say_what_is_left(n: int, session: weakref.ref[object]) -> None:
    def settled() -> bool:
        gc.collect()
        return session() is None and threads() == KEPT and not descriptors() - before[0]

    # grpc's poller thread ends as the session's last channel goes, and its descriptors (an
    # epoll and an eventfd) are closed a moment after, behind a loaded machine's other
    # processes: what is left once all of it settled, or SETTLE_S passed, is said below
    with contextlib.suppress(ClusterError):
        wait_until(settled, SETTLE_S, "the closed session to be collected")
    fds, count, exit_ = before
    print(f"{n}: session collected: {session() is None}", flush=True)
    print(f"{n}: threads: {threads()}", flush=True)
    print(f"{n}: new descriptors: {sorted(descriptors() - fds)}", flush=True)
    print(f"{n}: finalize at exit registered: {registered() - count}", flush=True)
    print(f"{n}: sys.exit given back: {sys.exit is exit_}", flush=True)
    fork_support = os.environ.get("GRPC_ENABLE_FORK_SUPPORT")
    print(f"{n}: GRPC_ENABLE_FORK_SUPPORT: {fork_support}", flush=True)


session = job(1)
with contextlib.suppress(SystemExit):
    sys.exit(1)  # caught: this job's business, not a later one's
cluster.finalize()
say_what_is_left(1, session)
session = job(2)
cluster.finalize()
say_what_is_left(2, session)
job(3)
print("3: returns", flush=True)
