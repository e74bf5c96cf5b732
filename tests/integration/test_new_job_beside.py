"""A whole job killed and its scheduler.json damaged, with real processes and files: the advice
each step gives is whole, and following it lets a job form.

Moving scheduler.json away alone (the advice was "move it away to start a new job") left a job
that could never form: its scheduler started a new job, and refused every worker that read its
own record of the old one, in a refusal cut off mid-sentence."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.integration.test_recovery import Job, run_scheduler
from tests.procs import Procs


def test_a_new_job_beside_the_old_jobs_records_says_what_to_move_and_then_forms(
    processes: Procs, tmp_path: Path
) -> None:
    job = Job(processes, tmp_path, 2)
    old = job.status()["cluster_id"]
    for proc in [job.scheduler, *job.workers]:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    state = job.state_dir / "scheduler.json"
    state.write_bytes(state.read_bytes()[:100])

    damaged = run_scheduler(tmp_path, job.state_dir)
    assert damaged.returncode == 2, damaged.stderr
    (line,) = [line for line in damaged.stderr.splitlines() if line.strip()]
    assert f"{state} is truncated or corrupt" in line
    assert "move the whole MS_RECOVERY_PATH directory away to start a new job" in line

    # The scheduler's state alone moved away: the new job says what the old one left there.
    state.rename(tmp_path / "scheduler.json.bad")
    job.scheduler = job.start_scheduler("scheduler-new")
    job.scheduler.wait_for_output("listening on", 15)
    job.scheduler.wait_for_output("there is no", 15)
    (beside,) = [line for line in job.scheduler.output.splitlines() if "there is no" in line]
    assert f"kv.log (job {old}); worker-0.json and worker-1.json (job {old})" in beside
    assert "presents that job and is refused: move them away" in beside

    refused = job.start_worker(1, "worker1-refused")
    assert refused.wait(30) == 1, refused.output
    (error,) = [line for line in refused.output.splitlines() if "RegistrationRefused" in line]
    assert f"node '1' belongs to job {old}" in error
    assert "worker-1.json in the MS_RECOVERY_PATH of its host" in error
    assert "move that record away and start the node again: it joins this job" in error
    assert error.endswith("start the node again with this job's own directory")

    # As the refusal says: the records moved away, the workers join the new job.
    for i in range(2):
        (job.state_dir / f"worker-{i}.json").rename(tmp_path / f"worker-{i}.json.old")
    job.workers = [job.start_worker(i, f"worker{i}-new") for i in range(2)]
    for worker in job.workers:
        worker.wait_for_output("allgather rank=", 30)
    assert job.status()["cluster_id"] not in ("", old)
    job.finish(job.workers)


def test_a_new_job_of_another_worker_count_forms_where_the_refusal_says(
    processes: Procs, tmp_path: Path
) -> None:
    """A whole job of 2 workers killed, then a job of 3 started on its MS_RECOVERY_PATH: the
    scheduler refuses in one line, saying what resumes the saved job and how a new one starts;
    done as it says, the new job forms. (Its advice was "move it away to start a new job": a
    new job started with scheduler.json alone moved away refused the workers that read their
    records of the saved job, for ever.)"""
    job = Job(processes, tmp_path, 2)
    old = job.status()["cluster_id"]
    for proc in [job.scheduler, *job.workers]:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert sorted(path.name for path in job.state_dir.glob("worker-*.json")) == [
        "worker-0.json",
        "worker-1.json",
    ]

    bigger = run_scheduler(tmp_path, job.state_dir, 30, worker_num=3)
    assert bigger.returncode == 2, bigger.stderr
    (line,) = [line for line in bigger.stderr.splitlines() if line.strip()]
    assert f"the recovery state {job.state_dir / 'scheduler.json'} cannot be resumed" in line
    assert f"it holds job {old} with MS_WORKER_NUM=2" in line
    assert "restart it with the job's values; to start a new job, move the whole " in line
    assert "MS_RECOVERY_PATH directory away, or give the new job one of its own" in line
    assert "on every host of the job" in line

    # As it says: the whole directory moved away, a job of 3 forms where it was.
    job.state_dir.rename(tmp_path / "recovery.old")
    new = Job(processes, tmp_path, 3)
    assert new.status()["cluster_id"] not in ("", old)
    new.finish(new.workers)
