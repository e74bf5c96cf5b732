"""A worker that goes on after its job: it joins, finalizes, says so (touches the file named by
its first argument) and carries on, without cluster, until something ends it."""

from __future__ import annotations

import sys
from pathlib import Path

import cluster
from cluster.testing import wait_until

cluster.init()
cluster.barrier()
cluster.finalize()
Path(sys.argv[1]).touch()
wait_until(lambda: False, 60, "this process to be ended")
