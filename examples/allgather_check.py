"""The tutorial's AllGather check, over `cluster`'s control plane.

Every worker joins the job, gathers every rank from every worker and prints one line:

    allgather rank=<r> size=<n> result=[0, 1, ..., n-1]

Start it once per worker and once more as the scheduler, with only MS_ROLE differing (see the
README). With --hold S a worker then stays in the job for S seconds, heartbeating, so that
failures can be injected. A worker restarted into a running job (recovery on) prints
`rejoined rank=<r> size=<n>` instead, and holds as asked.
"""

from __future__ import annotations

import argparse
import time

import cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", type=float, default=0.0, help="stay in the job this many seconds")
    args = parser.parse_args()

    cluster.init()  # in the scheduler role this serves the job and exits
    rank, size = cluster.get_rank(), cluster.get_group_size()
    if cluster.is_rejoin():
        # The others are past their gather (a restarted worker, with recovery on): join them.
        print(f"rejoined rank={rank} size={size}", flush=True)
    else:
        result = cluster.allgather_object(rank)
        print(f"allgather rank={rank} size={size} result={result}", flush=True)
    if args.hold > 0:
        time.sleep(args.hold)
    cluster.finalize()


if __name__ == "__main__":
    main()
