"""What finalizing cuts short, in a job of one worker.

thread: another thread's call waits (a key-value wait) when the main thread calls
    cluster.finalize(); then the main thread calls again, through the API and through the
    session it kept. Each prints what it got.
interrupt: recovery on; the program returns once the test has killed the scheduler (it writes
    the file CLUSTER_TEST_FLAG), and its finalize at exit waits for the scheduler to come
    back, until the test interrupts it (SIGINT).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import cluster
from cluster.api import runtime
from cluster.testing import wait_until

BOUND_S = 30.0

cluster.init()
session = runtime.session()
if sys.argv[1] == "interrupt":
    print("formed", flush=True)
    wait_until(Path(os.environ["CLUSTER_TEST_FLAG"]).exists, BOUND_S, "the scheduler's end")
    print("returning", flush=True)
    sys.exit(0)

entered = threading.Event()


async def waiting() -> list[bytes]:
    entered.set()
    return await session.agent.kv_wait(["never set"], BOUND_S)


def aside() -> None:
    try:
        session.call(waiting())
    except cluster.ClusterError as error:
        print(f"other thread's call: {type(error).__name__}: {error}", flush=True)


thread = threading.Thread(target=aside)
thread.start()
if not entered.wait(BOUND_S):
    raise SystemExit("the other thread's call never started")
cluster.finalize()
thread.join(BOUND_S)
try:
    cluster.kv_store().get("k")
except cluster.ClusterError as error:
    print(f"a call after finalize: {type(error).__name__}: {error}", flush=True)
try:
    session.call(session.agent.kv_get(["k"]))
except cluster.ClusterError as error:
    print(f"the kept session's call: {type(error).__name__}: {error}", flush=True)
