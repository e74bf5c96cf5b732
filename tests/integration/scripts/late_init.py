"""A worker slow to reach init(): it says it started (touches the file named by its first
argument), then waits for the file named by its second before calling `cluster.init()`, the way
a training script spends seconds importing its framework first."""

from __future__ import annotations

import sys
from pathlib import Path

import cluster
from cluster.testing import wait_until

started, go = Path(sys.argv[1]), Path(sys.argv[2])
started.touch()
wait_until(go.exists, 60, f"{go} to exist")
cluster.init()
print("init returned", flush=True)
cluster.finalize()
