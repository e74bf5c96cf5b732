"""One worker of a job with recovery on saves a checkpoint (so its state server and its writer
run), calls cluster.finalize(), and prints, as one JSON line, what is left of them afterwards:
whether its state server's port still accepts connections and which of its threads are alive,
each waited for up to BOUND_S to go."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

import cluster
from cluster.protocol import peer_state

BOUND_S = 10.0
NAMES = ("cluster-peer-state", "checkpoint-writer-")


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(NAMES))


def gone(check: Callable[[], object]) -> bool:
    """Whether `check()` turns false within BOUND_S."""
    deadline = time.monotonic() + BOUND_S
    while check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # sleep-ok: polling, bounded by BOUND_S
    return True


cluster.init()
checkpoints = cluster.CheckpointManager(sys.argv[1], "fin", cluster.CheckpointConfig(1, 2))
checkpoints.save(1, {"w": np.ones(4)})
checkpoints.flush()
# Where this worker serves, as it published it for its peers.
published = cluster.kv_store().get(peer_state.key(cluster.get_node_id()))
port = peer_state.Published.decode(published, cluster.get_node_id()).port
before = {"accepts": accepts(port), "threads": threads()}
cluster.finalize()
after = {"accepts": not gone(lambda: accepts(port)), "threads": [] if gone(threads) else threads()}
print(json.dumps({"before": before, "after": after}), flush=True)
