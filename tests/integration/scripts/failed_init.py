"""A worker whose init() fails (its scheduler is not up and MS_TOPO_TIMEOUT is short, or its
TLS client certificate's password is wrong): the program catches it and tries again, then goes
on without a job and returns normally. It prints what each step gave, the threads of cluster's
agent left, whether SIGUSR2 has its default action, GRPC_ENABLE_FORK_SUPPORT, and what its own
atexit handler saw."""

from __future__ import annotations

import atexit
import os
import signal
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
print(f"SIGUSR2 default: {signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL}", flush=True)
print(f"GRPC_ENABLE_FORK_SUPPORT: {os.environ.get('GRPC_ENABLE_FORK_SUPPORT')}", flush=True)
atexit.register(print, "atexit handler ran", flush=True)
print("going on without the job", flush=True)
