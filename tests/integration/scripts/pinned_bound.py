"""A worker that gives `cluster.init()` a config whose pinned-memory bound (the first argument)
is not its environment's CLUSTER_PINNED_MAX_BYTES. It asks for the process's host buffers before
init (made with the environment's bound) and once more after it, then for a pinned buffer one
byte over the config's bound; each line says what it saw."""

from __future__ import annotations

import dataclasses
import sys

import cluster
from cluster.protocol import environment
from cluster.storage import host_buffers

bound = int(sys.argv[1])
print(f"before init: bound {host_buffers.default_buffers().max_pinned}", flush=True)
cluster.init(dataclasses.replace(environment.from_env(), pinned_max_bytes=bound))
buffers = host_buffers.default_buffers()
print(f"after init: bound {buffers.max_pinned}", flush=True)
got = buffers.acquire(bound + 1, pinned=True)
print(f"over the bound: pinned={got.pinned} pinned_bytes={buffers.pinned_bytes}", flush=True)
cluster.finalize()
