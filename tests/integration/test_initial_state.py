"""The state of step 0 that a TrainingLoop keeps for a rollback to step 0, with real processes
(scripts/initial_state.py, two workers): let go once every rank holds a checkpoint, so that it
does not double a large state's memory for the job's life; and a rollback to step 0 after that
fails with one line that says what to do, which works."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.test_spare_state import EXIT_S, CounterJob
from tests.procs import ROOT, Procs

pytest.importorskip("numpy")

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "initial_state.py"
STATE_MIB = 64


def test_the_state_of_step_0_is_let_go_once_every_rank_holds_a_checkpoint(
    processes: Procs, tmp_path: Path
) -> None:
    """A 64 MiB state, saved every 2 steps. Once the scheduler has said that every rank holds a
    checkpoint, a worker holds, beyond the state, the loop's copy of its last step and the
    checkpoint writer's two (the budget the docs give): not a fourth, the state of step 0."""
    args = ("--mib", str(STATE_MIB), "--flush-in-step", "6", "--measure-in-step", "8")
    job = CounterJob(processes, tmp_path, args, with_spare=False, script=SCRIPT)
    for proc in job.workers:
        assert proc.wait(EXIT_S) == 0, proc.output
        found = re.search(r"grown by (\d+) MiB beyond the state", proc.output)
        assert found is not None, proc.output
        assert 2.5 * STATE_MIB < int(found.group(1)) < 3.5 * STATE_MIB, proc.output


def test_a_rollback_to_step_0_after_the_state_of_step_0_was_let_go_says_what_to_do(
    processes: Procs, tmp_path: Path
) -> None:
    """Node '0''s report says every rank holds its newest step, and tells the scheduler nothing:
    it lets the state of step 0 go, while every rollback step is 0. Node '1' dies in step 7 and
    is restarted: generation 2 rolls back to step 0, and node '0' stops with one line that says
    what happened and what to do. Done (node '0' restarted, making the state of step 0 again),
    the job finishes with the fault-free result."""
    args = ("--told-every-rank-holds", "--flush-in-step", "4", "--die-in-step", "7")
    job = CounterJob(processes, tmp_path, args, with_spare=False, script=SCRIPT)
    first = job.workers[0]
    assert job.workers[1].wait(EXIT_S) == 1, job.workers[1].output
    restarted = job.start("1")
    assert first.wait(EXIT_S) == 1, first.output
    line = "cluster: CheckpointError: generation 2 rolls back to step 0 (rank 1 (node '1' at "
    assert line in first.output, first.output
    assert "no longer holds the state of step 0" in first.output, first.output
    assert "Restart this worker" in first.output, first.output
    assert "Traceback" not in first.output, first.output
    again = job.start("0")
    for rank, proc in enumerate((again, restarted)):
        assert proc.wait(EXIT_S) == 0, proc.output
        assert f"node {rank} rank {rank} final w 10.0" in proc.output, proc.output
    assert job.scheduler.wait(EXIT_S) == 0, job.scheduler.output


def test_a_manager_told_no_recovery_in_a_job_with_recovery_stops_the_worker_in_one_line(
    processes: Procs, tmp_path: Path
) -> None:
    """The job runs with recovery (MS_ENABLE_RECOVERY=1, MS_RECOVERY_PATH); the script makes
    its CheckpointManager with recovery=False, and node '1' would die in step 1. The launch
    decides: each worker stops as it makes the manager, with one line that says what
    contradicts what and what to do. (The manager was taken at its word and the loop kept no
    state of step 0: once node '1' came back, node '0' stopped at the rollback to step 0 with
    a CheckpointError saying it had let that state go once every rank held a checkpoint,
    which none did.)"""
    args = ("--recovery-argument", "off", "--die-in-step", "1")
    job = CounterJob(processes, tmp_path, args, with_spare=False, script=SCRIPT)
    said = (
        "cluster: ConfigError: CheckpointManager(recovery=False) contradicts this job, which "
        "runs with recovery (MS_ENABLE_RECOVERY=1)"
    )
    for proc in job.workers:
        assert proc.wait(EXIT_S) == 1, proc.output
        assert said in proc.output, proc.output
        assert "Traceback" not in proc.output, proc.output
