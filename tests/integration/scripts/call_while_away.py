"""A worker for test_away_calls.py: once the file DOWN exists (the test killed the scheduler
and saw this worker lose it), it waits 1 s for a key nobody sets and prints what came of it;
then, the scheduler started again, it passes a barrier and finishes."""

from __future__ import annotations

import argparse
from pathlib import Path

import cluster
from cluster.testing import wait_until

WAIT_S = 60.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("down", type=Path)
    args = parser.parse_args()
    cluster.init()
    print("formed", flush=True)
    wait_until(args.down.exists, WAIT_S, f"{args.down} to appear")
    try:
        cluster.kv_store().wait(["never"], timeout_s=1)
    except cluster.CollectiveError as exc:
        print(f"kv wait: {type(exc).__name__}: {exc}", flush=True)
    cluster.barrier()
    print("barrier passed", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
