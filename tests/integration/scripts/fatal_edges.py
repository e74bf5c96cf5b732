"""Rank 1 dies (os._exit) once rank 0 is where the test wants the job's failure to find it
(rank 0 writes the file CLUSTER_TEST_FLAG there); recovery off.

exit: rank 0's program returns without cluster.finalize(); its finalize at exit waits in a
    closer (as cluster.torch's destroy) until the failure has arrived. It has atexit handlers
    registered before init() and after it.
finalize: rank 0 calls cluster.finalize(), whose closer (as cluster.torch's destroy) waits
    until the failure has arrived, and prints a line if it returns.
thread: a call of another thread of rank 0 is pending (as the checkpoint writer's report)
    while its main thread computes.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path

import cluster
from cluster.api import runtime
from cluster.testing import wait_until

BOUND_S = 30.0

atexit.register(print, "atexit handler registered before init()", flush=True)
cluster.init()
flag = Path(os.environ["CLUSTER_TEST_FLAG"])
if cluster.get_rank() == 1:
    wait_until(flag.exists, BOUND_S, "rank 0 to be ready")
    os._exit(3)

session = runtime.session()
if sys.argv[1] == "exit":
    atexit.register(print, "atexit handler registered after init()", flush=True)
    runtime.on_finalize(
        lambda: wait_until(lambda: session.agent.fatal is not None, BOUND_S, "the failure")
    )
    flag.write_text("")
    print("returning without finalize", flush=True)
    sys.exit(0)
if sys.argv[1] == "finalize":
    runtime.on_finalize(
        lambda: wait_until(lambda: session.agent.fatal is not None, BOUND_S, "the failure")
    )
    flag.write_text("")
    cluster.finalize()
    print("finalize returned", flush=True)
    sys.exit(0)

entered = threading.Event()


async def pending() -> None:
    entered.set()
    await session.agent.wait_generation(10**6)  # until the job's failure


def aside() -> None:
    try:
        session.call(pending())
    except cluster.ClusterError:
        print("the other thread's call raised", flush=True)


threading.Thread(target=aside, daemon=True).start()
if not entered.wait(BOUND_S):
    raise SystemExit("the other thread's call never started")
flag.write_text("")
deadline = time.monotonic() + BOUND_S
try:
    while time.monotonic() < deadline:
        sum(range(1000))  # pure Python: a signal's handler runs between bytecodes
    print("not interrupted", flush=True)
finally:
    print("finally ran", flush=True)
