"""A worker for test_gil.py: after a first barrier, rank 0 holds Python's GIL for HOLD_S
seconds in one C call (libc's usleep through ctypes.PyDLL, which keeps the GIL, as a
backtracking regex or the pickling of a large object does), then calls a second barrier."""

from __future__ import annotations

import argparse
import ctypes

import cluster


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("hold_s", type=float)
    args = parser.parse_args()
    cluster.init()
    cluster.barrier()
    if cluster.get_rank() == 0:
        ctypes.PyDLL(None).usleep(int(args.hold_s * 1e6))
    cluster.barrier()
    cluster.finalize()


if __name__ == "__main__":
    main()
