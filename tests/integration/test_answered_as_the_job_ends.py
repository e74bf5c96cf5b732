"""A main thread's cluster call whose answer comes as the job fails raises the failure: a real
worker's barrier is answered, and its peer dies before the call returns, while the agent counts
the call as waiting (so it sends no signal, leaving the error to the call). The call raises
JobFailedError, the program's `finally` runs, and the process ends with the one line, exit 1.

The call returned its answer, and the failure was left to the last resort: 5 s later an exit
at once, with no `finally` run and no atexit handler."""

from __future__ import annotations

from pathlib import Path

from cluster.testing import free_port
from tests.procs import ROOT, Procs, job_env

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "answered_as_the_job_ends.py")
BOUND_S = 60.0


def test_a_call_answered_as_the_job_fails_raises_the_failure(
    processes: Procs, tmp_path: Path
) -> None:
    env = job_env(2, free_port())
    args = [SCRIPT, "scheduler", str(tmp_path / "answered")]
    sched = processes.start_role("scheduler", "MS_SCHED", args, env)
    survivor = processes.start_role(
        "w0", "MS_WORKER", [SCRIPT, "survivor", args[2]], {**env, "MS_NODE_ID": "0"}
    )
    processes.start_role("w1", "MS_WORKER", [SCRIPT, "peer", args[2]], {**env, "MS_NODE_ID": "1"})
    assert survivor.wait(BOUND_S) == 1, survivor.output
    assert sched.wait(BOUND_S) == 1, sched.output
    lines = survivor.output.splitlines()
    assert "barrier returned" not in lines, survivor.output
    assert "finally ran" in lines, survivor.output
    assert lines[-1].startswith("cluster: JobFailedError: job failed: rank 1"), survivor.output
