"""A worker that does not come back: started again after a failure (its marker file in DIR
exists), it exits 1 at once, so the job fails MS_NODE_TIMEOUT + MS_TOPO_TIMEOUT after the
failure. Until then each worker gathers, again and again, for at most --limit seconds.

    no_comeback.py DIR [--limit S]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

# A failed worker that does not rejoin fails the job this soon after its guard.
os.environ["MS_TOPO_TIMEOUT"] = "5"

import cluster

parser = argparse.ArgumentParser()
parser.add_argument("dir", type=Path, help="where each worker marks that it started")
parser.add_argument("--limit", type=float, default=120.0)
args = parser.parse_args()

if os.environ.get("MS_ROLE") == "MS_WORKER":
    marker = args.dir / f"started-{os.environ['MS_NODE_ID']}"
    if marker.exists():
        raise SystemExit("started again: this worker does not come back")
    marker.touch()

cluster.init()
rank = cluster.get_rank()
deadline = time.monotonic() + args.limit
while time.monotonic() < deadline:
    with contextlib.suppress(cluster.PeerFailedError):  # a peer failed: recovered, or fails
        cluster.allgather_object(rank)  # raises once the job has failed
    time.sleep(0.1)  # sleep-ok: paces the gathers
cluster.finalize()
