"""A `LocalJob` ends with the process that owns it, even SIGKILLed (a killed `mscluster chaos`,
a pytest run killed by its CI): its scheduler, relay and workers watch their owner as a
launcher's children watch it, and its guard ends a worker that is stopped and cannot."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from cluster.testing import wait_until
from cluster.worker.orphan import proc_stat
from tests.procs import PYTHON, Procs, note_below, started_at

HOLDS = """\
import time
import cluster

cluster.init()
print("rank", cluster.get_rank(), flush=True)
time.sleep(600)  # sleep-ok: held until the job is ended
"""

# Owns a job of two workers and a relay, stops worker 0 (SIGSTOP: a chaos fault), says so and
# waits to be killed.
OWNER = """\
import sys, time
from pathlib import Path
from cluster.tools.testing import LocalJob, LocalJobOptions

script, workdir, ready = sys.argv[1:4]
job = LocalJob(script, workers=2, workdir=workdir, options=LocalJobOptions(relay=True))
job.start()
job.wait_formed()
job.stop_worker(0)
Path(ready).write_text(str(job.worker(0).pid))
time.sleep(600)  # sleep-ok: held until the test SIGKILLs it
"""


def test_a_sigkilled_owner_leaves_no_process_of_its_job_a_stopped_worker_neither(
    processes: Procs, tmp_path: Path, left: dict[int, str]
) -> None:
    script, owner = tmp_path / "holds.py", tmp_path / "owner.py"
    script.write_text(HOLDS)
    owner.write_text(OWNER)
    ready = tmp_path / "ready"
    run = processes.start(
        "owner", [PYTHON, str(owner), str(script), str(tmp_path / "job"), str(ready)], os.environ
    )
    wait_until(ready.exists, 60, "the job formed and worker 0 stopped")
    stopped = int(ready.read_text())
    note_below(run.pid, left)
    assert len(left) >= 4, left  # the scheduler, the relay, two workers (and the guard)
    assert stopped in left
    assert proc_stat(stopped)[0] == "T"  # type: ignore[index]

    run.popen.send_signal(signal.SIGKILL)
    run.wait(10)
    wait_until(
        lambda: not any(started_at(pid) == started for pid, started in left.items()),
        30,
        "no process of the job left",
    )
    worker_1 = (tmp_path / "job" / "worker_1.log").read_text()
    assert f"the launcher (pid {run.pid}) is gone" in worker_1, worker_1
