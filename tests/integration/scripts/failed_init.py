"""A worker whose scheduler is not up (MS_TOPO_TIMEOUT short): init() fails, the program
catches it and tries again, then goes on without a job and returns normally. It prints what
each step gave, the threads of cluster's agent left, and what its own atexit handler saw."""

from __future__ import annotations

import atexit
import threading

import cluster


def attempt(what: str) -> None:
    try:
        cluster.init()
    except cluster.ClusterError as error:
        print(f"{what}: {type(error).__name__}", flush=True)


attempt("first init")
attempt("second init")
try:
    cluster.get_rank()
except cluster.ClusterError as error:
    print(f"get_rank: {error}", flush=True)
agents = [t.name for t in threading.enumerate() if t.name.startswith("cluster-agent")]
print(f"agent threads: {agents}", flush=True)
atexit.register(print, "atexit handler ran", flush=True)
print("going on without the job", flush=True)
