"""Cluster calls belong to the process that called cluster.init(): a child it forks (a
DataLoader's worker, multiprocessing's fork context, os.fork) gets one line at once for a call
instead of a call that hangs forever, and exits at once without finalizing the job its parent
is in (nor crashing in gRPC's fork handlers). Real processes, real forks."""

from __future__ import annotations

from pathlib import Path

from cluster.testing import free_port
from tests.procs import ROOT, Procs, job_env

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "forked.py")
BOUND_S = 90.0
FORKED = (
    "ClusterError: cluster calls are only for the process that called cluster.init(); pass "
    "values to children instead"
)


def test_a_forked_child_neither_hangs_in_a_call_nor_finalizes_the_job(
    processes: Procs, tmp_path: Path
) -> None:
    recovery = {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": str(tmp_path / "recovery")}
    base = job_env(1, free_port(), FORKED_CHECKPOINTS=str(tmp_path / "checkpoints"), **recovery)
    sched = processes.start_role("scheduler", "MS_SCHED", [SCRIPT], base)
    worker = processes.start_role("w0", "MS_WORKER", [SCRIPT], {**base, "MS_NODE_ID": "0"})
    assert worker.wait(BOUND_S) == 0, worker.output
    assert sched.wait(BOUND_S) == 0, sched.output
    lines = worker.output.splitlines()
    assert "os.fork, call: 0 in time" in lines
    assert "multiprocessing, call: 0" in lines
    assert lines.count(f"child's call: {FORKED}") == 2  # one line in each
    assert "os.fork, exit: ['0 in time']" in lines
    assert "serving, os.fork, exit: ['0 in time']" in lines
    assert "worker finalized" in lines
    assert "job finished: all 1 nodes finished" in sched.output
