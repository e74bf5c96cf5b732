"""A worker for test_oversized.py: rank 0 broadcasts an object no collective carries, is
refused at once, and broadcasts a smaller one after it; the other ranks' broadcast it was
refused in fails for them too, and their next broadcast gets the smaller one. Rank 1 sets a
value the store does not take. Then every rank passes a barrier. Each prints what came of each
call."""

from __future__ import annotations

import cluster

BIG = 65 * 1024 * 1024


def main() -> None:
    cluster.init()
    rank = cluster.get_rank()
    if rank == 0:
        try:
            cluster.broadcast_object(b"z" * BIG)
        except cluster.CapacityError as exc:
            print(f"refused: {type(exc).__name__}: {exc}", flush=True)
        got = cluster.broadcast_object("a smaller one")
    else:
        try:
            cluster.broadcast_object(None)
        except cluster.CollectiveError as exc:
            print(f"withdrawn: {type(exc).__name__}: {exc}", flush=True)
        got = cluster.broadcast_object(None)
    print(f"rank={rank} got={got!r}", flush=True)
    if rank == 1:
        try:
            cluster.kv_store().set("big", b"x" * (4 * 1024 * 1024 + 1))
        except cluster.CapacityError as exc:
            print(f"kv refused: {type(exc).__name__}: {exc}", flush=True)
    cluster.barrier()
    print(f"barrier passed rank={rank}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
