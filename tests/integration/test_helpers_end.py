"""What a worker starts (a data server, a shell pipeline) ends with its job, also after the
worker itself exited: `mscluster run` and `LocalJob` stop each process group they started,
its leader's exit or not."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.testing import free_port, wait_until
from cluster.tools.processes import alive
from cluster.tools.testing import LocalJob
from tests.procs import Procs, run_args

# Every worker starts a helper in its own process group (a child's default) and notes its pid;
# rank 1 then exits 3, which fails the job, leaving its helper behind in its group. It waits
# for rank 0's note first: the job's failure would end rank 0 before it noted its helper.
LEAVES_A_HELPER = """\
import subprocess, sys, time
from pathlib import Path
import cluster

cluster.init()
rank = cluster.get_rank()
helper = subprocess.Popen(["sleep", "600"])
part = Path(sys.argv[1], f".helper_{rank}")  # written whole, then named: read whole
part.write_text(str(helper.pid))
part.rename(part.with_name(f"helper_{rank}"))
if rank == 1:
    deadline = time.monotonic() + 30
    while not Path(sys.argv[1], "helper_0").exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # sleep-ok: a bounded poll for rank 0's note
    sys.exit(3)
time.sleep(120)  # sleep-ok: the job fails under it
"""


@pytest.fixture
def noted(tmp_path: Path) -> Iterator[Path]:
    """Where the workers note their helpers' pids; a helper left when the test ends (it
    failed) is killed then, by its pid, once checked to be that helper still."""
    where = tmp_path / "noted"
    where.mkdir()
    yield where
    for path in where.glob("helper_*"):
        pid = int(path.read_text())
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x00600\x00":
                os.kill(pid, signal.SIGKILL)


def helpers(where: Path, count: int) -> list[int]:
    wait_until(lambda: len(list(where.glob("helper_*"))) == count, 30, "every helper's pid")
    return [int(path.read_text()) for path in where.glob("helper_*")]


def test_the_launcher_stops_the_helper_of_a_worker_that_exited(
    processes: Procs, tmp_path: Path, noted: Path
) -> None:
    script = tmp_path / "helper.py"
    script.write_text(LEAVES_A_HELPER)
    args = run_args(script, noted, worker_num=2, master_port=free_port(), log_dir=tmp_path / "logs")
    run = processes.start("run", args, os.environ)
    pids = helpers(noted, 2)
    assert run.wait(60) == 1, run.output
    assert "worker 1 (rank 1, node id '1') exited with code 3" in run.output, run.output
    wait_until(lambda: not any(alive(pid) for pid in pids), 10, "no helper left")


def test_local_job_close_stops_the_helper_of_a_worker_that_exited(
    tmp_path: Path, noted: Path
) -> None:
    script = tmp_path / "helper.py"
    script.write_text(LEAVES_A_HELPER)
    with LocalJob(script, [str(noted)], workers=2, workdir=tmp_path / "job") as job:
        pids = helpers(noted, 2)
        job.worker(1).wait(30)
    wait_until(lambda: not any(alive(pid) for pid in pids), 10, "no helper left")
