"""A worker for test_withdrawn.py: in three collectives one rank's contribution is past what a
collective carries while the other rank already waits in it: rank 0's broadcast_object (the
root's), rank 1's allgather_object, rank 1's allreduce. The rank refused in its own process
gets its own error; the waiting rank gets the scheduler's, which names that rank and the size.
The refused rank makes no collective until the waiting rank has heard (a key of the store, which
takes no collective number), as a rank that goes on with its work before its next collective
does. Then both ranks make the same collective again with a small value. Each prints what came
of each call (the waiting rank: how long it waited), then every rank passes a barrier.

The refused rank calls once the test has seen the other rank wait in the round: the test
creates the file `<WITHDRAWN_GO>.<step>` then.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cluster
from cluster.testing import wait_until

BIG = 65 * 1024 * 1024
# How long the refused rank waits for the other to have heard (the test waits less).
HEARD_S = 120.0
# Each step: the rank refused for its payload, the call it makes, the other rank's call, and the
# call both make after it.
STEPS: list[tuple[int, Callable[[], Any], Callable[[], Any], Callable[[], Any]]] = [
    (
        0,
        lambda: cluster.broadcast_object(b"z" * BIG),
        lambda: cluster.broadcast_object(None),
        lambda: cluster.broadcast_object(f"after, from rank {cluster.get_rank()}"),
    ),
    (
        1,
        lambda: cluster.allgather_object(b"z" * BIG),
        lambda: cluster.allgather_object("small"),
        lambda: cluster.allgather_object(cluster.get_rank()),
    ),
    (
        1,
        lambda: cluster.allreduce(_full(BIG // 8, 0)),
        lambda: cluster.allreduce(_full(4, 0)),
        lambda: cluster.allreduce(_full(4, cluster.get_rank() + 1)).tolist(),
    ),
]


def _full(n: int, value: int) -> Any:
    import numpy as np  # noqa: PLC0415 - numpy only for the allreduce step

    return np.full(n, float(value))


def main() -> None:
    cluster.init()
    rank = cluster.get_rank()
    go = os.environ["WITHDRAWN_GO"]
    for step, (refused, too_big, waiting, after) in enumerate(STEPS, start=1):
        if rank == refused:
            wait_until(Path(f"{go}.{step}").exists, 30, f"the test's go for step {step}")
            try:
                too_big()
            except cluster.ClusterError as exc:
                print(f"step {step} refused here: {type(exc).__name__}: {exc}", flush=True)
            cluster.kv_store().wait(f"heard {step}", timeout_s=HEARD_S)
        else:
            began = time.monotonic()
            try:
                got = waiting()
            except cluster.ClusterError as exc:
                waited = time.monotonic() - began
                print(f"step {step} waited {waited:.1f} s: {type(exc).__name__}: {exc}", flush=True)
            else:
                print(f"step {step} waiting rank got {got!r}", flush=True)
            cluster.kv_store().set(f"heard {step}", "yes")
        print(f"step {step} after: {after()!r}", flush=True)
    cluster.barrier()
    print(f"barrier passed rank={rank}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
