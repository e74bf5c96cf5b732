"""A worker that ends with a non-zero status after init() is a failure, not a finish, however
it got there: sys.exit(N), sys.exit("message"), exit(N), an argparse error, or an uncaught
exception printed by a hook of the program's own. The scheduler fails the node naming the
status or the error, the job fails (recovery off), and with recovery on the node's own file
says it has not finished (a restart of it rejoins the job). Real processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.testing import free_port
from cluster.worker import node_file
from tests.procs import ROOT, Procs, job_env

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "exit_status.py")
BOUND_S = 30.0


def start_job(processes: Procs, mode: str, **extra: str) -> list[object]:
    base = job_env(2, free_port(), **extra)
    sched = processes.start_role("scheduler", "MS_SCHED", [SCRIPT, mode], base)
    workers = [
        processes.start_role(f"w{i}", "MS_WORKER", [SCRIPT, mode], {**base, "MS_NODE_ID": str(i)})
        for i in range(2)
    ]
    return [sched, *workers]


@pytest.mark.parametrize(
    ("mode", "status", "told"),
    [
        ("sys_exit", 1, "exited with status 1"),
        ("message", 1, "exited with status 1: loss is NaN"),
        ("builtin_exit", 3, "exited with status 3"),
        ("argparse", 2, "exited with status 2"),
        ("hook", 1, "RuntimeError: CUDA out of memory"),
    ],
)
def test_a_worker_that_exits_non_zero_fails_the_job_in_words(
    processes: Procs, mode: str, status: int, told: str
) -> None:
    sched, rank0, rank1 = start_job(processes, mode)
    assert rank1.wait(BOUND_S) == status, rank1.output
    assert rank0.wait(BOUND_S) == 1, rank0.output
    assert sched.wait(BOUND_S) == 1, sched.output
    reason = f"died: its process died of an error: {told}"
    assert f"node '1' (rank 1) failed: its process died of an error: {told}\n" in sched.output
    assert "job finished" not in sched.output
    [line] = [line for line in rank0.output.splitlines() if line.startswith("cluster: ")]
    # The barrier's failure or the job's, as it finds rank 0: rank 1 named with its reason.
    assert line.startswith("cluster: JobFailedError: "), rank0.output
    assert "rank 1 (node '1'" in line, rank0.output
    assert line.endswith(reason), rank0.output
    assert "has already finished" not in rank0.output


def test_with_recovery_a_worker_that_exits_non_zero_has_not_finished(
    processes: Procs, tmp_path: Path
) -> None:
    state = tmp_path / "recovery"
    _sched, rank0, rank1 = start_job(
        processes, "sys_exit", MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(state)
    )
    assert rank1.wait(BOUND_S) == 1, rank1.output
    rank0.wait_for_output("barrier: ", BOUND_S)
    assert "exited with status 1" in rank0.output, rank0.output
    record = node_file.load(state, "1")
    assert record is not None
    assert not record.finished  # a restart of node 1 takes its rank back
