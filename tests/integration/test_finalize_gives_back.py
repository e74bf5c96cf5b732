"""What `cluster.finalize()` gives back, in a real worker process under a launcher that joins
three jobs one after the other (tests/integration/scripts/gives_back.py): after each finalize
the closed session is collected (its grpc channel with it, and grpc's poller thread and
descriptors), the one thread left is the process's launcher watch (one, however many jobs),
the finalize at exit is registered no more, `sys.exit` is Python's again and
GRPC_ENABLE_FORK_SUPPORT is unset again; a `sys.exit(1)` caught in the first job is not told as
the third job's end.

The launcher watch held each closed session (its ending, which held the session's `say`), with
its channel, loop and grpc's poller thread, a watch thread more for each job; each init()
registered the finalize at exit once more; and the status of the first job's `sys.exit(1)`
was told at exit as the third job's failure."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from cluster.testing import Process, free_port
from tests.procs import MSCLUSTER, ROOT, Procs, job_env

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "gives_back.py")
BOUND_S = 60.0


def scheduler(processes: Procs, n: int, env: Mapping[str, str]) -> Process:
    return processes.start(
        f"scheduler{n}", [*MSCLUSTER, "scheduler"], {**env, "MS_ROLE": "MS_SCHED"}
    )


def left_after(n: int) -> list[str]:
    return [
        f"{n}: session collected: True",
        f"{n}: threads: ['cluster-launcher-watch']",
        f"{n}: new descriptors: []",
        f"{n}: finalize at exit registered: 0",
        f"{n}: sys.exit given back: True",
        f"{n}: GRPC_ENABLE_FORK_SUPPORT: None",
    ]


def test_finalize_gives_back_what_init_took_job_after_job(processes: Procs, tmp_path: Path) -> None:
    # This test process is the worker's launcher: the worker watches it.
    env = job_env(1, free_port(), CLUSTER_LAUNCHER_PID=str(os.getpid()), MS_NODE_ID="0")
    worker = processes.start_role("w0", "MS_WORKER", [SCRIPT, str(tmp_path)], env)
    for n in (1, 2):
        sched = scheduler(processes, n, env)
        (tmp_path / f"job-{n}").touch()
        worker.wait_for_output(f"{n}: GRPC_ENABLE_FORK_SUPPORT", BOUND_S)
        assert sched.wait(BOUND_S) == 0, sched.output
        said = [line for line in worker.output.splitlines() if line.startswith(f"{n}: ")]
        assert said == left_after(n), worker.output
    sched = scheduler(processes, 3, env)
    (tmp_path / "job-3").touch()
    assert worker.wait(BOUND_S) == 0, worker.output
    assert "3: returns" in worker.output
    # The third job ended well: the first job's caught sys.exit(1) is not its status.
    assert sched.wait(BOUND_S) == 0, sched.output
    assert "exited with status" not in sched.output, sched.output
    assert "Traceback" not in worker.output
