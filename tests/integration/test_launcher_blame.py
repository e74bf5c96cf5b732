"""`mscluster run` names the worker whose own exit failed the job, not one that died of it."""

from __future__ import annotations

import os
from pathlib import Path

from cluster.testing import free_port
from tests.procs import Procs, run_args

# Rank 2 gives up with a line of its own and exit code 3; the scheduler fails the job, and the
# other ranks die of that (JobFailedError), after rank 2's exit as in a real job: each waits
# until rank 2's process is gone (reaped by the launcher) before it exits.
GIVES_UP = """\
import os, sys, time
from pathlib import Path
import cluster

pid_file = Path(sys.argv[1])
cluster.init()
if cluster.get_rank() == 2:
    pid_file.write_text(str(os.getpid()))
    print("rank 2: the data shard is missing; giving up", flush=True)
    sys.exit(3)
try:
    time.sleep(120)  # sleep-ok: the job fails under it
except cluster.JobFailedError as exc:
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid_file.read_text()}") and time.monotonic() < deadline:
        time.sleep(0.0001)  # sleep-ok: a bounded look for rank 2's exit
    print(f"cluster: JobFailedError: {exc}", flush=True)  # as cluster's excepthook says it
    os._exit(1)
"""


def test_the_worker_that_exited_first_of_its_own_is_blamed_and_its_log_tailed(
    processes: Procs, tmp_path: Path
) -> None:
    script = tmp_path / "gives_up.py"
    script.write_text(GIVES_UP)
    logs = tmp_path / "logs"
    args = run_args(
        script, tmp_path / "rank2.pid", worker_num=4, master_port=free_port(), log_dir=logs
    )
    run = processes.start("run", args, os.environ)
    assert run.wait(60) == 1, run.output
    # Others died of the job's failure, after rank 2 (a slow one is stopped by the launcher).
    assert any("JobFailedError" in (logs / f"worker_{i}.log").read_text() for i in (0, 1, 3))
    assert "worker 2 (rank 2, node id '2') exited with code 3" in run.output, run.output
    assert f"last lines of {logs / 'worker_2.log'}:" in run.output, run.output
    assert "    rank 2: the data shard is missing; giving up" in run.output, run.output
    assert "worker 0 (rank 0" not in run.output, run.output
