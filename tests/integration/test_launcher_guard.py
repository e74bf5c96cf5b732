"""`mscluster run` SIGKILLed leaves no process of its job, one that is stopped neither: a
stopped worker cannot run its own watch of the launcher, and the launcher's guard ends it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from cluster.testing import free_port, wait_until
from cluster.tools.guard import GRACE_S
from cluster.worker.orphan import proc_stat
from tests.procs import Procs, launched, note_below, private_copy, run_args, started_at


def test_a_sigkilled_launcher_leaves_no_process_a_stopped_worker_neither(
    processes: Procs, tmp_path: Path, left: dict[int, str]
) -> None:
    script = private_copy(tmp_path)
    logs = tmp_path / "logs"
    args = run_args(script, "--hold", "60", worker_num=2, master_port=free_port(), log_dir=logs)
    run = processes.start("run", args, os.environ)
    run.wait_for_output("2/2 registered (ready)", 30)
    worker_0 = launched(logs, "worker_0")
    os.kill(worker_0, signal.SIGSTOP)  # a chaos "stop" fault, a Ctrl-Z, a debugger
    wait_until(lambda: (proc_stat(worker_0) or ["?"])[0] == "T", 10, "worker 0 stopped")
    note_below(run.pid, left)
    assert len(left) >= 4, left  # the scheduler, the relay, two workers (and the guard)
    assert worker_0 in left

    run.popen.send_signal(signal.SIGKILL)
    run.wait(10)
    wait_until(lambda: started_at(worker_0) != left[worker_0], 5, "the stopped worker 0 SIGKILLed")
    wait_until(
        lambda: not any(started_at(pid) == started for pid, started in left.items()),
        GRACE_S + 10,
        "no process of the job left",
    )
