"""A worker whose Finish fails with an error of its own (a RuntimeError from `agent.finish()`,
planted, while the agent's loop runs on) says so in one line, naming the error and that the
scheduler sees its connection close instead of a Finish, and still lets go of its session
(tests/integration/scripts/finish_fails.py). The scheduler, told nothing, sees the node's
stream close: the job fails. A Finish at exit that finds the executor shut by the interpreter's
exit (a RuntimeError too) is the process exiting anyway: nothing is said.

The finalize took any RuntimeError for the interpreter's exit ("exiting anyway") and said
nothing: the node never told the scheduler it finished, and the user heard nothing of why."""

from __future__ import annotations

import pytest

from cluster.testing import Process, free_port
from tests.procs import MSCLUSTER, ROOT, Procs, job_env

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "finish_fails.py")
BOUND_S = 60.0


def job(processes: Procs, how: str, status: int = 0) -> tuple[Process, Process]:
    """The scheduler and the one worker of a job whose Finish fails `how` (the worker exits
    with `status`); both ended."""
    env = job_env(1, free_port(), MS_NODE_ID="0")
    sched = processes.start("scheduler", [*MSCLUSTER, "scheduler"], {**env, "MS_ROLE": "MS_SCHED"})
    worker = processes.start_role("w0", "MS_WORKER", [SCRIPT, how], env)
    assert worker.wait(BOUND_S) == status, worker.output
    # Told no finish, the scheduler sees the node's stream close (recovery is off).
    assert sched.wait(BOUND_S) == 1, sched.output
    assert "died: its connection to the scheduler broke" in sched.output, sched.output
    return sched, worker


def test_a_finish_that_fails_of_an_error_of_its_own_says_so_and_lets_go(
    processes: Procs,
) -> None:
    _, worker = job(processes, "bug")
    lines = worker.output.splitlines()
    said = [line for line in lines if "could not" in line]
    assert said == [
        "cluster[rank 0]: could not tell the scheduler that this node finished "
        "(RuntimeError: planted: agent.finish failed): it sees this node's connection close "
        "instead of a Finish"
    ], worker.output
    assert "finalized" in lines, worker.output
    assert "agent threads: []" in lines, worker.output
    assert "Traceback" not in worker.output, worker.output


@pytest.mark.parametrize("how", ["exit", "exit-loaded"])
def test_a_finish_at_exit_that_finds_the_executor_shut_exits_without_a_word(
    processes: Procs, how: str
) -> None:
    _, worker = job(processes, how)
    assert "the executor took it" not in worker.output, worker.output
    assert worker.output.splitlines() == ["in rank=0"], worker.output


def test_a_failure_report_that_fails_of_an_error_of_its_own_says_so(processes: Procs) -> None:
    _, worker = job(processes, "report", status=1)
    said = [line for line in worker.output.splitlines() if "could not" in line]
    assert said == [
        "cluster[rank 0]: could not tell the scheduler what this process dies of "
        "(RuntimeError: planted: the report failed): it sees this node's connection close "
        "instead"
    ], worker.output
    assert "ValueError: the program's own error" in worker.output, worker.output
