"""A worker for the recovery tests: gathers (or says it rejoined), holds until released, then
gathers once more in whatever generation the job has reached, and finishes.

`--go FILE`: says `ready` once in the job and gathers only once FILE exists. A first gather
that fails with PeerFailedError (the job re-formed under it) is said (`cut rank=...`) instead
of gathered. `--generation N`: once released, waits for generation N before the last gather.
`--add`: in place of the first gather, adds 1 to the counter `n` and says the answer
(`added value=...`) and what the counter holds then (`holds n=...`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import cluster

parser = argparse.ArgumentParser()
parser.add_argument("--release", required=True, help="hold until this file exists")
parser.add_argument("--limit", type=float, default=120.0, help="give up holding after this long")
parser.add_argument("--go", help="gather only once this file exists")
parser.add_argument("--generation", type=int, default=0, help="the last gather's generation")
parser.add_argument("--add", action="store_true", help="add to a counter, not gather, first")
args = parser.parse_args()


def wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + args.limit
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: never {what}")
        time.sleep(0.05)  # sleep-ok: polls a file the test makes, bounded by --limit


cluster.init()
rank, size = cluster.get_rank(), cluster.get_group_size()
if cluster.is_rejoin():
    print(f"rejoined rank={rank} size={size} generation={cluster.get_generation()}", flush=True)
else:
    if args.go:
        print(f"ready rank={rank}", flush=True)
        wait_for(Path(args.go), "told to go")
    if args.add:
        store = cluster.kv_store()
        print(f"added value={store.add('n', 1)}", flush=True)
        print(f"holds n={store.get('n').decode()}", flush=True)
    else:
        try:
            gathered = cluster.allgather_object(rank)
            print(f"allgather rank={rank} size={size} result={gathered}", flush=True)
        except cluster.PeerFailedError as exc:
            print(f"cut rank={rank}: {exc}", flush=True)
wait_for(Path(args.release), "released")
if cluster.get_generation() < args.generation:
    cluster.wait_for_generation(args.generation - 1, args.limit)
gathered = cluster.allgather_object(rank)
print(f"after rank={rank} generation={cluster.get_generation()} result={gathered}", flush=True)
cluster.finalize()
