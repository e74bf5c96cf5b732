"""Rank 0 misbehaves as told (crash: an uncaught exception; leave: finalize early); the others
enter a barrier that rank 0 never reaches."""

from __future__ import annotations

import sys

import cluster

cluster.init()
if cluster.get_rank() == 0:
    if sys.argv[1] == "crash":
        raise RuntimeError("boom")
    cluster.finalize()
    sys.exit(0)
cluster.barrier()
