"""A worker for test_finish_after_failed.py: it joins, says `ready`, waits for the file its
argument names (at most CUE_S), then finalizes and says so."""

from __future__ import annotations

import sys
from pathlib import Path

import cluster
from cluster.testing import wait_until

CUE_S = 60.0

cluster.init()
print(f"ready rank={cluster.get_rank()}", flush=True)
wait_until(Path(sys.argv[1]).exists, CUE_S, "the test's cue")
cluster.finalize()
print("finalized", flush=True)
