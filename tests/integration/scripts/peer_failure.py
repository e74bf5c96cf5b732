"""With recovery on: rank 0 waits in a collective while the test kills rank 1; prints how each
collective call ended."""

from __future__ import annotations

import time

import cluster

cluster.init()
if cluster.get_rank() == 1:
    print("rank 1 ready", flush=True)
    time.sleep(60)  # sleep-ok: the test kills this process; this only keeps it alive meanwhile
else:
    for attempt in ("in flight", "afterwards"):
        print(f"gathering ({attempt})", flush=True)
        try:
            cluster.allgather_object(0)
        except cluster.PeerFailedError as exc:
            print(f"{attempt}: PeerFailedError: {exc}", flush=True)
