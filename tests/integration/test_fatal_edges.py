"""A job's failure ends every worker with one line and a non-zero exit wherever it finds the
main thread: in the finalize that runs at exit, or computing while another thread's call waits.
Real processes: recovery off, rank 1 dies."""

from __future__ import annotations

from pathlib import Path

from cluster.testing import free_port
from tests.procs import ROOT, Procs, job_env

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "fatal_edges.py")


def run_job(processes: Procs, tmp_path: Path, mode: str) -> str:
    """Rank 0's output, once every process of the job ended as a failed job's should."""
    port = free_port()
    base = job_env(2, port, CLUSTER_TEST_FLAG=str(tmp_path / "ready"))
    sched = processes.start_role("scheduler", "MS_SCHED", [SCRIPT, mode], base)
    workers = [
        processes.start_role(f"w{i}", "MS_WORKER", [SCRIPT, mode], {**base, "MS_NODE_ID": str(i)})
        for i in range(2)
    ]
    assert workers[1].wait(30) == 3, workers[1].output
    assert workers[0].wait(30) == 1, workers[0].output
    assert sched.wait(30) != 0, sched.output
    return workers[0].output


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("cluster: ")]


def test_a_failure_during_the_finalize_at_exit_is_one_line_and_exit_1(
    processes: Procs, tmp_path: Path
) -> None:
    # Rank 0's closer (at exit) waits until the failure has arrived: it is not interrupted
    # (no warning that it failed), and the finalize ends the process with the failure, after
    # every other atexit handler ran, each once.
    output = run_job(processes, tmp_path, "exit")
    [line] = error_lines(output)
    assert line.startswith("cluster: JobFailedError: job failed: rank 1 "), output
    assert output.splitlines() == [
        "returning without finalize",
        "atexit handler registered after init()",
        line,
        "atexit handler registered before init()",
    ]


def test_a_failure_during_cluster_finalize_is_raised_by_it_once_it_has_closed(
    processes: Procs, tmp_path: Path
) -> None:
    # Rank 0's closer waits until the failure has arrived: it is not interrupted (no warning
    # that it failed), and finalize() raises the failure at its end, whenever it ends.
    output = run_job(processes, tmp_path, "finalize")
    [line] = error_lines(output)
    assert line.startswith("cluster: JobFailedError: job failed: rank 1 "), output
    assert output.splitlines() == [line, "atexit handler registered before init()"]


def test_a_call_of_another_thread_does_not_keep_the_failure_from_the_main_thread(
    processes: Procs, tmp_path: Path
) -> None:
    output = run_job(processes, tmp_path, "thread")
    # The main thread was interrupted with the job's error: its finally block ran (the last
    # resort would have ended the process without it) and the error is the uncaught one line.
    assert "finally ran" in output, output
    assert "not interrupted" not in output
    assert "Traceback" not in output
    [line] = error_lines(output)
    assert "rank 1" in line, output
