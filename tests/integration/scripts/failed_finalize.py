"""A worker of a job that fails (argument `survivor`): once in the job it says "waiting" and
waits outside any cluster call; the job's JobFailedError (its peer was killed) is raised there
and caught, its finalize raises it again and that is caught too; it then says whether the closed
session was collected and which threads are left, and carries on, for the last resort to end
it. Argument `peer`: joins the job and waits to be killed."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import weakref

import cluster
from cluster.api import runtime
from cluster.protocol.errors import JobFailedError
from cluster.testing import wait_until

BOUND_S = 60.0

cluster.init()
session = weakref.ref(runtime.session())
cluster.barrier()
if sys.argv[1] == "peer":
    wait_until(lambda: False, BOUND_S, "this process to be killed")
print("waiting", flush=True)
try:
    wait_until(lambda: False, BOUND_S, "the job's failure")
except JobFailedError:
    print("the job failed", flush=True)
try:
    cluster.finalize()
except JobFailedError:
    print("finalize raised it", flush=True)


def settled() -> bool:
    gc.collect()
    return session() is None


# Within the last resort's grace; what is left is said below.
with contextlib.suppress(cluster.ClusterError):
    wait_until(settled, 3.0, "the closed session to be collected")
print(f"session collected: {session() is None}", flush=True)
polling = [t.name for t in threading.enumerate() if "_poll_wrapper" in t.name]
print(f"grpc poller threads: {polling}", flush=True)
wait_until(lambda: False, BOUND_S, "the last resort to end this process")
