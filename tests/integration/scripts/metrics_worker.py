"""A worker whose /metrics is on (CLUSTER_WORKER_METRICS_PORT): once in the job, a barrier (its
first collective) starts it, and it says so; it calls `cluster.finalize()` once the file named
by its first argument exists."""

from __future__ import annotations

import sys
from pathlib import Path

import cluster
from cluster.testing import wait_until

cluster.init()
cluster.barrier()
print("metrics on", flush=True)
go = Path(sys.argv[1])
wait_until(go.exists, 120, f"{go} to exist")
cluster.finalize()
