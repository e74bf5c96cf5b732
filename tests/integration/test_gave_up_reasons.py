"""A worker that gives up registering names what the scheduler answered, with real processes:
a claimant of a live node id refused by the guard for its whole MS_TOPO_TIMEOUT, and a restarted
worker whose answer a scheduler on a full disk holds. Both were told "is it running, and are
MS_SCHED_HOST / MS_SCHED_PORT right?", though the scheduler had answered every try."""

from __future__ import annotations

from pathlib import Path

from tests import tmpfs
from tests.integration.test_recovery import Job
from tests.procs import Procs

ADDRESS_HINT = "MS_SCHED_HOST / MS_SCHED_PORT"


def gave_up(job: Job, name: str, **env: str) -> str:
    """The error line of a process of node '1' started with `env` (as well as the job's), which
    gives up registering: exit 1, and not the address doubted."""
    worker = job.processes.start_role(name, "MS_WORKER", job.args, {**job.env, **env})
    assert worker.wait(30) == 1, worker.output
    (line,) = [line for line in worker.output.splitlines() if "TopologyTimeoutError" in line]
    assert ADDRESS_HINT not in line
    return line


def test_a_claimant_refused_for_its_whole_wait_names_the_guard(
    processes: Procs, tmp_path: Path
) -> None:
    job = Job(processes, tmp_path, 2)
    elsewhere = str(tmp_path / "elsewhere")  # as from another host
    line = gave_up(job, "claimant", MS_NODE_ID="1", MS_RECOVERY_PATH=elsewhere, MS_TOPO_TIMEOUT="3")
    assert "did not accept this node in time: it refused this node for the whole wait" in line
    assert "the last time because node id '1' is held by a live process" in line
    assert "two processes of this job have the same MS_NODE_ID?" in line
    job.finish(job.workers)


def test_a_worker_whose_answer_a_full_disk_holds_names_the_hold(processes: Procs) -> None:
    with tmpfs.mounted("1m") as disk:
        try:
            job = Job(processes, disk, 2)  # its state on the small disk
            tmpfs.fill(disk)
            job.workers[1].popen.kill()
            job.workers[1].wait(10)
            # Taken back after its guard (MS_NODE_TIMEOUT=5 s), in memory only: the answer waits
            # for a save, which the full disk refuses.
            line = gave_up(job, "w1-again", MS_NODE_ID="1", MS_TOPO_TIMEOUT="9")
            assert "did not accept this node in time: it took this node's registration" in line
            assert "it answers once it has saved what the registration changes" in line
        finally:
            processes.kill_all()
