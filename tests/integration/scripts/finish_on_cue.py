"""A worker that finishes on cue: once in the job it says its rank, then calls
`cluster.finalize()` once the file named by its first argument exists."""

from __future__ import annotations

import sys
from pathlib import Path

import cluster
from cluster.testing import wait_until

cluster.init()
print(f"in rank={cluster.get_rank()}", flush=True)
go = Path(sys.argv[1])
wait_until(go.exists, 120, f"{go} to exist")
print("finalizing", flush=True)
cluster.finalize()
print("finalized", flush=True)
