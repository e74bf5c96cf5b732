"""A worker of a job of one forks after cluster.init(): a child that makes a cluster call (a
bare os.fork, and multiprocessing's fork context, as a DataLoader's workers), and children that
exit normally (their atexit handlers run; gRPC's fork handlers crashed about one in six). Each
child is bounded by SIGALRM; the worker prints how they ended, then makes its own calls and
finalizes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import cluster

BOUND_S = 20
IN_TIME_S = 5.0  # a child's exit takes milliseconds; one that finalizes the job, seconds
EXITS = 12


def call() -> None:
    signal.alarm(BOUND_S)  # a call that hangs ends the child (SIGALRM), not the test
    try:
        cluster.kv_store().set("from a child", b"x")
    except cluster.ClusterError as error:
        print(f"child's call: {type(error).__name__}: {error}", flush=True)
        sys.exit(0)
    sys.exit(7)


def forked(child: str) -> str:
    """How a child forked to run `child` ended: its exit code, and whether in time."""
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        if child == "call":
            call()
        signal.alarm(BOUND_S)
        sys.exit(0)  # a helper that returns: its atexit handlers run
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    took = "in time" if time.monotonic() - started < IN_TIME_S else "late"
    return f"{code} {took}"


cluster.init()
print(f"os.fork, call: {forked('call')}", flush=True)
print(f"os.fork, exit: {sorted({forked('exit') for _ in range(EXITS)})}", flush=True)
process = multiprocessing.get_context("fork").Process(target=call)
process.start()
process.join(BOUND_S + 5)
print(f"multiprocessing, call: {process.exitcode}", flush=True)
cluster.barrier()
cluster.kv_store().set("from the worker", b"x")
cluster.finalize()
print("worker finalized", flush=True)
