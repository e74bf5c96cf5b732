"""A call whose own deadline passes while the scheduler is away (recovery on) says so: where
the scheduler went, how much longer it is waited for, and what brings it back; started again
on its state, the job goes on (real processes)."""

from __future__ import annotations

from pathlib import Path

from cluster.testing import LocalJob, LocalJobOptions
from tests.procs import PYTHON, ROOT

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "call_while_away.py"


def test_a_kv_wait_that_times_out_while_the_scheduler_is_away_says_so(tmp_path: Path) -> None:
    down = tmp_path / "down"
    job = LocalJob(
        SCRIPT,
        [str(down)],
        workers=1,
        node_timeout_s=3,
        workdir=tmp_path / "job",
        timeout_s=60,
        options=LocalJobOptions(env={"MS_TOPO_TIMEOUT": "30"}, python=PYTHON),
    )
    with job:
        job.worker(0).wait_for_output("formed", 30)
        job.kill_scheduler()
        job.worker(0).wait_for_output("lost the scheduler", 30)
        down.touch()
        job.worker(0).wait_for_output("kv wait: ", 30)
        job.restart_scheduler(wait=False)
        assert job.wait(60) == 0, job.log(0)
    log = job.log(0)
    assert (
        f"kv wait: CollectiveError: kv wait: no answer before its deadline, as the scheduler at "
        f"{job.address} is away ("
    ) in log, log
    assert (
        "more for it, 30 s (the longer of MS_NODE_TIMEOUT and MS_TOPO_TIMEOUT, recovery on) in "
        "all: start it again on the job's saved state (the same MS_RECOVERY_PATH or "
        "CLUSTER_STATE_URL) within that time, and the workers go on"
    ) in log, log
    assert "barrier passed" in log, log
