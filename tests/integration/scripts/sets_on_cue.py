"""A worker for test_member_floods.py: it joins, says `ready`, waits for the file its argument
names (at most CUE_S), then sets a key of its own SETS times, one after another, and says how
many sets went through and how many failed (with the first failure), then finalizes."""

from __future__ import annotations

import sys
from pathlib import Path

import cluster
from cluster.testing import wait_until

CUE_S = 60.0
SETS = 20

cluster.init()
rank = cluster.get_rank()
print(f"ready rank={rank}", flush=True)
wait_until(Path(sys.argv[1]).exists, CUE_S, "the test's cue")
store = cluster.kv_store()
done = failed = 0
for _ in range(SETS):
    try:
        store.set(f"key of {rank}", b"x")
        done += 1
    except cluster.ClusterError as exc:
        failed += 1
        if failed == 1:
            print(f"first failure: {type(exc).__name__}: {exc}", flush=True)
print(f"sets rank={rank} done={done} failed={failed}", flush=True)
cluster.finalize()
