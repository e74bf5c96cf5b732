"""A worker with /metrics on (CLUSTER_WORKER_METRICS_PORT) in two jobs, one after the other,
in one process: once in a job, a barrier starts its metrics ("metrics on N"); it finalizes once
the file `go-N` (in the directory of its first argument) exists, and then says whether its
metrics port can be bound ("port free after finalize N", or the error) and whether the port's
serving thread still runs. After the first job it waits for `again` and calls init() anew."""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path

import cluster
from cluster.testing import wait_until

here = Path(sys.argv[1])
port = int(os.environ["CLUSTER_WORKER_METRICS_PORT"])


def job(n: int) -> None:
    cluster.init()
    cluster.barrier()
    print(f"metrics on {n}", flush=True)
    go = here / f"go-{n}"
    wait_until(go.exists, 120, f"{go} to exist")
    cluster.finalize()
    # As a server does (HTTPServer: SO_REUSEADDR): refused while anything listens on the port.
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            probe.listen()
        except OSError as exc:
            print(f"port taken after finalize {n}: {exc}", flush=True)
        else:
            print(f"port free after finalize {n}", flush=True)
    serving = [t.name for t in threading.enumerate() if t.name == "cluster-worker-metrics"]
    print(f"serving threads after finalize {n}: {serving}", flush=True)


job(1)
wait_until((here / "again").exists, 120, "the next job's scheduler")
job(2)
