"""A worker of a job of one forks after cluster.init(): a child that makes a cluster call (a
bare os.fork, and multiprocessing's fork context, as a DataLoader's workers), and children that
exit normally (their atexit handlers run; gRPC's fork handlers crashed about one in six), also
while a CheckpointManager serves this rank's checkpoints to peers (recovery is on). Each
child is bounded by SIGALRM; the worker prints how they ended, then makes its own calls and
finalizes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import numpy as np

import cluster
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager

BOUND_S = 20
# A child's exit takes milliseconds; one that finalizes the job, or waits out a call on its
# parent's threads, seconds.
IN_TIME_S = 2.0
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
# With recovery on, a CheckpointManager serves this rank's checkpoints to peers from a loop
# thread of this process, which its children do not have: their exit leaves it alone.
manager = CheckpointManager(os.environ["FORKED_CHECKPOINTS"], "net", CheckpointConfig())
manager.save(1, {"w": np.zeros(4)})
manager.flush()
print(f"serving, os.fork, exit: {sorted({forked('exit') for _ in range(3)})}", flush=True)
manager.close()
process = multiprocessing.get_context("fork").Process(target=call)
process.start()
process.join(BOUND_S + 5)
print(f"multiprocessing, call: {process.exitcode}", flush=True)
cluster.barrier()
cluster.kv_store().set("from the worker", b"x")
cluster.finalize()
print("worker finalized", flush=True)
