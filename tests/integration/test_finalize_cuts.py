"""What cluster.finalize() cuts short says so: another thread's call that waited, a call made
after it, and a Ctrl-C during the finalize at exit (one line and status 130, not a traceback
of an atexit callback and status 0). Real processes, a real SIGINT."""

from __future__ import annotations

import signal
from pathlib import Path

from cluster.testing import free_port
from tests.procs import ROOT, Procs, job_env

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "finalize_cuts.py")
BOUND_S = 30.0
FINALIZED = "this worker was finalized (cluster.finalize(), or at exit): no cluster call follows"


def test_calls_cut_by_finalize_or_after_it_say_so(processes: Procs) -> None:
    base = job_env(1, free_port())
    sched = processes.start_role("scheduler", "MS_SCHED", [SCRIPT, "thread"], base)
    worker = processes.start_role("w0", "MS_WORKER", [SCRIPT, "thread"], base)
    assert worker.wait(BOUND_S) == 0, worker.output
    assert sched.wait(BOUND_S) == 0, sched.output
    assert worker.output.splitlines() == [
        "other thread's call: ClusterError: the job was finalized while this call waited",
        f"a call after finalize: NotInitializedError: {FINALIZED}",
        f"the kept session's call: ClusterError: {FINALIZED}",
    ]


def test_ctrl_c_during_the_finalize_at_exit_is_one_line_and_status_130(
    processes: Procs, tmp_path: Path
) -> None:
    flag = tmp_path / "scheduler-killed"
    base = job_env(
        1,
        free_port(),
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
        MS_NODE_ID="0",
        CLUSTER_TEST_FLAG=str(flag),
    )
    sched = processes.start_role("scheduler", "MS_SCHED", [SCRIPT, "interrupt"], base)
    worker = processes.start_role("w0", "MS_WORKER", [SCRIPT, "interrupt"], base)
    worker.wait_for_output("formed", BOUND_S)
    sched.kill_group()
    flag.write_text("")
    worker.wait_for_output("this node's finish waits for it", BOUND_S)
    worker.signal(signal.SIGINT)
    assert worker.wait(BOUND_S) == 130, worker.output
    assert "cluster: KeyboardInterrupt: interrupted while this worker finalized at exit" in (
        worker.output
    )
    assert "Exception ignored" not in worker.output
    assert "Traceback" not in worker.output
