"""A worker of a failed job whose finalize raised the failure holds nothing of its session while
the last resort is pending: a real worker catches the job's JobFailedError and finalize's, and
finds its closed session collected and grpc's poller thread ended; the last resort, which stays
(see docs/guide/failures.md), still ends the process 5 s later with its line and exit 1.

The last resort's timer held the session (its ending, which held the session's `say`) until it
fired, and with it the channel, its loop and grpc's poller thread."""

from __future__ import annotations

from cluster.testing import free_port
from tests.procs import ROOT, Procs, job_env

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "failed_finalize.py")
BOUND_S = 60.0


def test_a_failed_jobs_finalize_leaves_nothing_of_the_session_to_the_last_resort(
    processes: Procs,
) -> None:
    env = job_env(2, free_port())
    sched = processes.start_role("scheduler", "MS_SCHED", [SCRIPT, "scheduler"], env)
    survivor = processes.start_role(
        "w0", "MS_WORKER", [SCRIPT, "survivor"], {**env, "MS_NODE_ID": "0"}
    )
    peer = processes.start_role("w1", "MS_WORKER", [SCRIPT, "peer"], {**env, "MS_NODE_ID": "1"})
    survivor.wait_for_output("waiting", BOUND_S)  # past the barrier: in no cluster call
    peer.kill_group()
    assert survivor.wait(BOUND_S) == 1, survivor.output
    assert sched.wait(BOUND_S) == 1, sched.output
    lines = survivor.output.splitlines()
    for said in ("the job failed", "finalize raised it", "session collected: True"):
        assert said in lines, survivor.output
    assert "grpc poller threads: []" in lines, survivor.output
    # The last resort's line, with the session's prefix: the job's failure, naming rank 1.
    assert lines[-1].startswith("cluster[rank 0]: job failed: rank 1"), survivor.output
