"""A worker for test_gil.py: after a first barrier, rank 0 holds Python's GIL for HOLD_S
seconds in one C call (libc's usleep through ctypes.PyDLL, which keeps the GIL, as a
backtracking regex or the pickling of a large object does), then calls a second barrier.

With recovery the scheduler fails rank 0 meanwhile and takes it back: the second barrier
cannot complete in the generation it began in (PeerFailedError), so each rank waits for the
generation that rank 0's return makes and passes the barrier there, as a recovery-aware loop
does (without, the job's failure is raised and ends the process)."""

from __future__ import annotations

import argparse
import ctypes

import cluster

REJOIN_WAIT_S = 60.0  # a bound: the job's MS_TOPO_TIMEOUT ends it sooner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("hold_s", type=float)
    args = parser.parse_args()
    cluster.init()
    cluster.barrier()
    generation = cluster.get_generation()
    if cluster.get_rank() == 0:
        ctypes.PyDLL(None).usleep(int(args.hold_s * 1e6))
    try:
        cluster.barrier()
    except cluster.PeerFailedError as exc:
        print(f"rank {cluster.get_rank()}: {exc}", flush=True)
        now = cluster.wait_for_generation(generation, REJOIN_WAIT_S)
        cluster.barrier()
        print(f"rank {cluster.get_rank()} passed the barrier in generation {now}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
