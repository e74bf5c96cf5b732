"""A worker stopped (SIGSTOP) past MS_NODE_TIMEOUT and then continued says, when its job or its
stream ends for it, that this process was stopped or starved and for how long: not that it lost
the scheduler, nor that the scheduler went silent (its own silence timer once took the stop for
the scheduler's, and cancelled the stream for it). With recovery it rejoins and the job
finishes; without, it fails with the job. Real processes, a real SIGSTOP."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from cluster.testing import free_port, wait_until
from tests.integration.test_finish_after_failed import BOUND_S, start_cued
from tests.procs import Procs, job_env

NODE_S = 2.0
OWN = "this process was stopped or starved for"
BLAMES = ("lost the scheduler", "no heartbeat from the scheduler", "(hung or cut off?)")


@pytest.mark.parametrize("recovery", [True, False], ids=["recovery", "no-recovery"])
def test_a_worker_stopped_past_the_node_timeout_says_it_was_stopped(
    processes: Procs, tmp_path: Path, recovery: bool
) -> None:
    extra = {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": str(tmp_path / "rec")}
    base = job_env(
        2,
        free_port(),
        MS_NODE_TIMEOUT=f"{NODE_S:g}",
        MS_TOPO_TIMEOUT="30",
        **(extra if recovery else {}),
    )
    sched, workers = start_cued(processes, tmp_path, base)
    workers[1].signal(signal.SIGSTOP)
    wait_until(workers[1].stopped, BOUND_S, "worker 1 stopped")
    sched.wait_for_output("node '1' (rank 1) failed: no heartbeat", BOUND_S)
    time.sleep(NODE_S)  # sleep-ok: the fault's length: the stop outlasts MS_NODE_TIMEOUT
    workers[1].signal(signal.SIGCONT)
    if recovery:
        sched.wait_for_output("node '1' rejoined", BOUND_S)
        for i in (0, 1):
            (tmp_path / f"go{i}").touch()
        assert [worker.wait(BOUND_S) for worker in workers] == [0, 0], workers[1].output
    else:
        assert workers[1].wait(BOUND_S) == 1, workers[1].output
    said = workers[1].output
    assert OWN in said, said
    assert not [blame for blame in BLAMES if blame in said], said
