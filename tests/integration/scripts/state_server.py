"""A worker's state server alone, in a process of its own: serves the checkpoints under ROOT
(prefix PREFIX, rank RANK, in a job of WORKERS workers) on 127.0.0.1, port 0, and prints
`published <json>` once it listens; on SIGTERM it stops and exits 0.

    python tests/integration/scripts/state_server.py ROOT PREFIX RANK WORKERS
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from cluster.storage.served import ServedCheckpoints
from cluster.worker.session import BackgroundLoop
from cluster.worker.state_server import StateServer


def main() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    root, prefix, rank, workers = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    server = StateServer("127.0.0.1", workers)
    server.offer(ServedCheckpoints(root, prefix, rank))
    loop = BackgroundLoop("state-server")
    loop.run(server.start(), timeout_s=10)
    print(f"published {server.published.encode().decode()}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    loop.run(server.stop(0.5), timeout_s=5)
    loop.stop()


if __name__ == "__main__":
    main()
