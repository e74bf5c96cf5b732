"""A worker's metrics port (CLUSTER_WORKER_METRICS_PORT) against whoever reaches it: a real
worker of a real job serving /metrics, and an outsider in another process (this one, from
127.0.0.2) opening hundreds of connections that send nothing. The worker holds a bounded number
of threads and descriptors for them, the rest closed at once, so its own files, gRPC and NCCL
keep theirs; and a scrape from another address still answers at once."""

from __future__ import annotations

import contextlib
import os
import time
import urllib.request
from pathlib import Path

from cluster.testing import free_port
from cluster.transport.bounded_http import CONNECTIONS_PER_ADDRESS, REQUEST_S
from tests.integration.test_metrics_port import open_idle, still_open
from tests.procs import ROOT, Procs, job_env

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "metrics_worker.py")
BOUND_S = 30.0
IDLE_CONNECTIONS = 400
# Threads and descriptors the worker may open beside the connections it serves (gRPC's own
# come and go).
SLACK = 8


def threads_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    threads = next(
        int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:")
    )
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def test_idle_connections_hold_few_of_a_workers_threads_and_fds(
    processes: Procs, tmp_path: Path
) -> None:
    port = free_port()
    go = tmp_path / "go"
    env = job_env(1, free_port(), CLUSTER_WORKER_METRICS_PORT=str(port))
    sched = processes.start_role("scheduler", "MS_SCHED", [SCRIPT, str(go)], env)
    worker = processes.start_role("w0", "MS_WORKER", [SCRIPT, str(go)], env)
    worker.wait_for_output("metrics on", BOUND_S)
    assert "cluster_worker_info" in scrape(port)
    threads, fds = threads_and_fds(worker.pid)
    held = open_idle(port, IDLE_CONNECTIONS)
    try:
        assert len(held) == IDLE_CONNECTIONS  # taken at once, none left waiting
        now_threads, now_fds = threads_and_fds(worker.pid)
        assert now_threads <= threads + CONNECTIONS_PER_ADDRESS + SLACK, (threads, now_threads)
        assert now_fds <= fds + CONNECTIONS_PER_ADDRESS + SLACK, (fds, now_fds)
        started = time.monotonic()
        assert "cluster_worker_steps_total" in scrape(port)
        assert time.monotonic() - started < 2.0
        # Past the address's share, closed at once; the others once silent long enough.
        served = still_open(held, 1.0)
        assert len(served) <= CONNECTIONS_PER_ADDRESS
        assert still_open(served, REQUEST_S + BOUND_S) == []
    finally:
        for conn in held:
            with contextlib.suppress(OSError):
                conn.close()
    go.write_text("")
    assert worker.wait(BOUND_S) == 0, worker.output
    assert sched.wait(BOUND_S) == 0, sched.output
