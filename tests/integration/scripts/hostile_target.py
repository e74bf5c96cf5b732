"""A worker for test_hostile.py: joins, gathers every rank, and waits where the test says.

Rank 0 gathers at once and waits there for rank 1; rank 1 first waits until the file GO exists,
so that the test's forged calls are made while rank 0 waits in its collective. Then both pass a
barrier, print their generation and finish.
"""

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
    rank = cluster.get_rank()
    peers = [(p.node_id, p.host, p.port) for p in cluster.get_peers()]
    print(f"joined rank={rank} peers={peers}", flush=True)
    if rank == 0:
        print("gathering", flush=True)
    else:
        wait_until(args.go.exists, WAIT_S, f"{args.go} to appear")
    result = cluster.allgather_object(rank)
    print(f"gathered rank={rank} result={result}", flush=True)
    cluster.barrier()
    print(f"done rank={rank} generation={cluster.get_generation()}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
