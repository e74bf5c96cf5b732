"""A worker for the recovery tests: gathers (or says it rejoined), holds until released, then
gathers once more in whatever generation the job has reached, and finishes."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import cluster

parser = argparse.ArgumentParser()
parser.add_argument("--release", required=True, help="hold until this file exists")
parser.add_argument("--limit", type=float, default=120.0, help="give up holding after this long")
args = parser.parse_args()

cluster.init()
rank, size = cluster.get_rank(), cluster.get_group_size()
if cluster.is_rejoin():
    print(f"rejoined rank={rank} size={size} generation={cluster.get_generation()}", flush=True)
else:
    gathered = cluster.allgather_object(rank)
    print(f"allgather rank={rank} size={size} result={gathered}", flush=True)
deadline = time.monotonic() + args.limit
while not Path(args.release).exists():
    if time.monotonic() > deadline:
        sys.exit(f"rank {rank}: never released")
    time.sleep(0.05)  # sleep-ok: polls the release file, bounded by --limit
gathered = cluster.allgather_object(rank)
print(f"after rank={rank} generation={cluster.get_generation()} result={gathered}", flush=True)
cluster.finalize()
