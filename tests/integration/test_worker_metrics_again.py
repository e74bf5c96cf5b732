"""A worker's metrics port (CLUSTER_WORKER_METRICS_PORT) ends with its job: a real worker
process serves /metrics, finalizes, and finds the port free (it binds it) with no serving
thread left; it joins a second job with init() and serves /metrics there again, and exits 0.

The port used to stay bound, and its thread to run, for the rest of the process: a program that
finalized and went on found the port taken, and a second job's metrics could not be had."""

from __future__ import annotations

from pathlib import Path

from cluster.testing import free_port
from tests.integration.test_worker_metrics_port import scrape
from tests.procs import ROOT, Procs, job_env

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "metrics_again_worker.py")
BOUND_S = 30.0


def test_finalize_frees_the_metrics_port_and_a_next_job_serves_it_again(
    processes: Procs, tmp_path: Path
) -> None:
    port = free_port()
    env = job_env(1, free_port(), CLUSTER_WORKER_METRICS_PORT=str(port))
    args = [SCRIPT, str(tmp_path)]
    sched = processes.start_role("scheduler1", "MS_SCHED", args, env)
    worker = processes.start_role("w0", "MS_WORKER", args, env)
    worker.wait_for_output("metrics on 1", BOUND_S)
    assert "cluster_worker_info" in scrape(port)
    (tmp_path / "go-1").touch()
    worker.wait_for_output("serving threads after finalize 1", BOUND_S)
    assert "port free after finalize 1" in worker.output, worker.output
    assert "serving threads after finalize 1: []" in worker.output
    assert sched.wait(BOUND_S) == 0, sched.output

    # A second job in the same process: its metrics are served on the same port again.
    sched = processes.start_role("scheduler2", "MS_SCHED", args, env)
    sched.wait_for_output("listening on", BOUND_S)
    (tmp_path / "again").touch()
    worker.wait_for_output("metrics on 2", BOUND_S)
    assert "cluster_worker_steps_total" in scrape(port)
    (tmp_path / "go-2").touch()
    assert worker.wait(BOUND_S) == 0, worker.output
    assert "port free after finalize 2" in worker.output, worker.output
    assert "serving threads after finalize 2: []" in worker.output
    assert "Traceback" not in worker.output
    assert sched.wait(BOUND_S) == 0, sched.output
