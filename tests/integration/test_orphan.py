"""A launcher SIGKILLed while its workers are still on their way to init(): they end at init().
One SIGKILLed after a worker finalized and went on: that worker ends too, as the launcher would
have ended it (SIGTERM), not by the closed session's failure."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from cluster.testing import free_port, wait_until
from tests.procs import ROOT, Procs, launched, run_args

LATE_INIT = ROOT / "tests" / "integration" / "scripts" / "late_init.py"
AFTER_FINALIZE = ROOT / "tests" / "integration" / "scripts" / "after_finalize.py"


def parent_of(pid: int) -> int | None:
    """The parent of a running process; None once it has exited (or is a zombie)."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[1])


def test_a_worker_before_init_ends_at_init_when_the_launcher_was_sigkilled(
    processes: Procs, tmp_path: Path
) -> None:
    started, go, logs = tmp_path / "started", tmp_path / "go", tmp_path / "logs"
    args = run_args(LATE_INIT, started, go, worker_num=1, master_port=free_port(), log_dir=logs)
    run = processes.start("run", args, os.environ)
    wait_until(started.exists, 30, "the worker to start")
    worker = launched(logs, "worker_0")
    run.popen.send_signal(signal.SIGKILL)
    run.wait(10)
    wait_until(lambda: parent_of(worker) != run.pid, 10, "the worker to be re-parented")
    go.touch()  # the worker calls init() now, its launcher long gone
    wait_until(lambda: parent_of(worker) is None, 15, "the orphaned worker to end")
    log = (logs / "worker_0.log").read_text()
    assert f"the launcher (pid {run.pid}) is gone" in log, log
    assert "init returned" not in log, log


def test_a_worker_that_finalized_and_went_on_ends_when_the_launcher_is_sigkilled(
    processes: Procs, tmp_path: Path
) -> None:
    finalized, logs = tmp_path / "finalized", tmp_path / "logs"
    args = run_args(AFTER_FINALIZE, finalized, worker_num=1, master_port=free_port(), log_dir=logs)
    run = processes.start("run", args, os.environ)
    wait_until(finalized.exists, 60, "the worker to finalize")
    worker = launched(logs, "worker_0")
    run.popen.send_signal(signal.SIGKILL)
    run.wait(10)
    wait_until(lambda: parent_of(worker) is None, 15, "the worker to end")
    log = (logs / "worker_0.log").read_text()
    # The process's launcher watch, no longer the closed session's: the line, then SIGTERM.
    assert f"cluster: the launcher (pid {run.pid}) is gone; stopping this process" in log, log
    assert "job failed" not in log, log
