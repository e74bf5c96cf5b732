"""`mscluster run --enable-recovery`: failures that come together, and failures after a node
finished its part, under a real launcher, scheduler and workers."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from cluster.testing import Process, free_port, wait_until
from tests.procs import Procs, launched, processes_running, run_args

# A worker of the job: it says whether it is a first start or a rejoin, then trains (waits)
# until the test creates the file named by its first argument, within a bound, and finalizes.
TRAINS_UNTIL_TOLD = """\
import sys, time
from pathlib import Path
import cluster
cluster.init()
rank = cluster.get_rank()
print(f"{'rejoined' if cluster.is_rejoin() else 'first'} rank={rank}", flush=True)
go, deadline = Path(sys.argv[1]), time.monotonic() + 90
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)  # sleep-ok: training, a bounded look for the test's word
print(f"trained rank={rank}", flush=True)
cluster.finalize()
print(f"finalized rank={rank}", flush=True)
"""


def start_run(
    processes: Procs, tmp_path: Path, script: str, *extra: str
) -> tuple[Process, Path, Path]:
    """`mscluster run` of `script` (2 workers, recovery, node timeout 3 s), its log directory
    and the file that ends the workers' training."""
    path = tmp_path / "job" / "train.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    go = tmp_path / "go"
    logs = tmp_path / "logs"
    recovery = ("--enable-recovery", "--node-timeout", "3", *extra)
    args = run_args(*recovery, path, go, worker_num=2, master_port=free_port(), log_dir=logs)
    return processes.start("run", args, os.environ), logs, go


def logged(logs: Path, name: str, text: str) -> bool:
    log = logs / f"{name}.log"
    return log.exists() and text in log.read_text(errors="replace")


def wait_logged(run: Process, logs: Path, name: str, text: str, timeout_s: float = 60) -> None:
    """Until `text` is in the log of process `name`; the launcher's output when it exits
    first, or after `timeout_s`."""
    wait_until(lambda: logged(logs, name, text) or not run.running, timeout_s, repr(text))
    assert logged(logs, name, text), run.output


def test_a_scheduler_and_a_worker_killed_together_are_both_started_again(
    processes: Procs, tmp_path: Path
) -> None:
    """The OOM killer takes the scheduler and worker 1 at once: the launcher starts the
    scheduler again, waits for it to answer (it is running: starting, not gone), then starts
    worker 1 again, which rejoins; the job finishes and the launcher exits 0."""
    run, logs, go = start_run(processes, tmp_path, TRAINS_UNTIL_TOLD, "--max-restarts", "3")
    run.wait_for_output("2/2 registered (ready)", 30)
    wait_logged(run, logs, "worker_1", "first rank=1")
    scheduler, worker = launched(logs, "scheduler"), launched(logs, "worker_1")
    os.kill(scheduler, signal.SIGKILL)
    os.kill(worker, signal.SIGKILL)
    wait_logged(run, logs, "worker_1", "rejoined rank=1")
    go.touch()
    assert run.wait(60) == 0, run.output
    assert "scheduler restart 1 of 3" in run.output
    assert "worker 1 (rank 1, node id '1') was killed by SIGKILL; restarting it" in run.output
    assert "job failed" not in run.output
    assert "after 1 restart and 1 scheduler restart" in run.output, run.output
    assert logged(logs, "worker_0", "finalized rank=0")
    assert logged(logs, "scheduler", "job finished")
    assert not processes_running(str(tmp_path / "job"))


# Rank 1 finishes its part early (finalize) and then hangs in its teardown, where the test kills
# it (an NCCL destructor's segfault); rank 0 trains on until the test creates the file.
FINISHES_EARLY = """\
import sys, time
from pathlib import Path
import cluster
cluster.init()
rank = cluster.get_rank()
print(f"{'rejoined' if cluster.is_rejoin() else 'first'} rank={rank}", flush=True)
if rank == 1:
    cluster.finalize()
    print("finalized rank=1", flush=True)
    time.sleep(90)  # sleep-ok: its teardown, where the test kills it
    sys.exit(0)
go, deadline = Path(sys.argv[1]), time.monotonic() + 90
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)  # sleep-ok: training, a bounded look for the test's word
print("trained rank=0", flush=True)
cluster.finalize()
print("finalized rank=0", flush=True)
"""


def test_a_worker_killed_after_it_finished_its_part_is_noted_and_the_job_finishes(
    processes: Procs, tmp_path: Path
) -> None:
    """Rank 1 called finalize() (the scheduler counts it finished) and dies in its teardown
    while rank 0 trains on: it is not started again (a node id finishes once: a new process
    would be refused), nor does it fail the job; rank 0 completes its training, the job
    finishes, and the launcher says so and exits 1, as a worker did not exit 0."""
    run, logs, go = start_run(processes, tmp_path, FINISHES_EARLY, "--max-restarts", "2")
    wait_logged(run, logs, "worker_1", "finalized rank=1")
    os.kill(launched(logs, "worker_1"), signal.SIGKILL)
    noted = (
        "worker 1 (rank 1, node id '1') was killed by SIGKILL after it finished its part of "
        "the job: not restarted"
    )
    wait_until(lambda: noted in run.output or not run.running, 30, "the launcher's note")
    assert noted in run.output, run.output
    go.touch()
    assert run.wait(60) == 1, run.output
    assert logged(logs, "worker_0", "finalized rank=0"), run.output
    assert "restarting it" not in run.output
    assert "job failed" not in run.output
    assert "job finished: 1 local worker exited 0" in run.output, run.output
    assert (
        "exiting 1: worker 1 (rank 1, node id '1') was killed by SIGKILL after it finished "
        "its part of the job" in run.output
    ), run.output
    assert logged(logs, "scheduler", "job finished")
    assert not processes_running(str(tmp_path / "job"))
