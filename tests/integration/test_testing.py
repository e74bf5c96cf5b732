"""cluster.testing: the fault-injection API and fixture, on real processes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cluster.protocol.errors import ConfigError, JobTimeoutError
from cluster.tools.testing import LocalJob, wait_until
from tests.procs import ROOT

WORKER = ROOT / "tests" / "integration" / "scripts" / "recovery_worker.py"


def test_every_fault_waits_for_its_effect(
    local_job: Callable[..., LocalJob], tmp_path: Path
) -> None:
    release = tmp_path / "release"
    job = local_job(WORKER, ["--release", str(release)], workers=3, node_timeout_s=2)
    formed = job.wait_formed()
    assert formed.generation == 1
    # The script's first gather must be done: a failure during it is not handled there.
    wait_until(lambda: all("allgather rank=" in job.log(i) for i in range(3)), 30, "gathers")

    detected = job.kill_worker(1)
    assert detected < 2.0  # a killed process is seen through its broken stream
    job.restart_worker(1)
    assert job.status().generation == 2
    # The scheduler publishes the generation before the rejoined process prints it.
    wait_until(lambda: "rejoined rank=1 size=3" in job.log(1), 30, "worker 1's rejoin line")

    job.kill_scheduler()
    job.restart_scheduler()
    assert job.status().generation == 2

    job.stop_worker(0)  # hung for less than MS_NODE_TIMEOUT: tolerated
    job.continue_worker(0)
    assert job.status().generation == 2

    job.stop_worker(2)  # hung for longer: failed, then back with the same process
    job.wait_status(lambda v: job.node(v, 2).state == "failed", "worker 2 failed")
    job.continue_worker(2)
    job.wait_status(lambda v: v.generation == 3 and job.everyone_back(v), "generation 3")

    release.touch()
    assert job.wait() == 0
    for i in range(3):
        assert "after rank=" in job.log(i)


def test_waiting_for_a_job_that_ended_ends_with_its_exit(
    local_job: Callable[..., LocalJob], tmp_path: Path
) -> None:
    script = tmp_path / "dies.py"
    script.write_text('raise SystemExit("boom: the script died")\n')
    job = local_job(script, workers=2, node_timeout_s=2, timeout_s=30)
    with pytest.raises(JobTimeoutError, match="exited 1: boom: the script died"):
        job.wait_formed()


def test_a_job_that_does_not_end_in_time_names_what_still_runs(
    local_job: Callable[..., LocalJob], tmp_path: Path
) -> None:
    """`wait` past its bound says which processes still run, with the end of their logs."""
    release = tmp_path / "release"
    job = local_job(WORKER, ["--release", str(release)], workers=2, node_timeout_s=2)
    job.wait_formed()
    wait_until(lambda: all("allgather rank=" in job.log(i) for i in range(2)), 30, "gathers")
    with pytest.raises(JobTimeoutError) as raised:
        job.wait(timeout_s=0.5)
    said = str(raised.value)
    assert "worker_0 still runs, its log ending: " in said, said
    assert "allgather rank=0 size=2" in said, said
    release.touch()
    assert job.wait() == 0


def test_a_guard_that_is_no_positive_number_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="node_timeout_s='inf' is out of range"):
        LocalJob(WORKER, workers=2, node_timeout_s=float("inf"), workdir=tmp_path)
