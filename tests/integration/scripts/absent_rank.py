"""A worker for test_shares.py: every rank but the last calls a barrier at once; the last one
comes only once the file GO exists (the test touches it after the others' barrier failed), and
gets the same failure. Every rank prints what its barrier ended in, then finishes once all
have."""

from __future__ import annotations

import argparse
from pathlib import Path

import cluster
from cluster.testing import wait_until

WAIT_S = 120.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("go", type=Path)
    args = parser.parse_args()
    cluster.init()
    rank, size = cluster.get_rank(), cluster.get_group_size()
    if rank == size - 1:
        wait_until(args.go.exists, WAIT_S, f"{args.go} to appear")
    try:
        cluster.barrier()
        print(f"barrier passed rank={rank}", flush=True)
    except cluster.CollectiveError as exc:
        print(f"barrier failed rank={rank}: {exc}", flush=True)
    # The job goes on past the failed collective: the store works for every rank, and each
    # waits there for the others (so the last rank meets the failure, not a finished job).
    store = cluster.kv_store()
    store.set(f"after/{rank}", b"ok")
    store.wait([f"after/{r}" for r in range(size)], WAIT_S)
    print(f"done rank={rank}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
