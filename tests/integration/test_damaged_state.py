"""The scheduler's saved state damaged behind its lock while the job runs: the scheduler, which
holds the lock and so is the file's only writer, keeps the damaged copy beside it, says so once,
and saves its own state again; the job goes on. (At start-up a damaged state is refused instead:
there the file is all the scheduler knows of the job.)"""

from __future__ import annotations

from pathlib import Path

from cluster.scheduler.persist import STATE_KIND
from cluster.storage import store
from cluster.storage.directory_store import STATE_FILE
from cluster.tools.testing import LocalJob, LocalJobOptions, wait_until
from tests.procs import PYTHON, ROOT

WORKER = ROOT / "tests" / "integration" / "scripts" / "recovery_worker.py"


def test_a_state_damaged_mid_run_is_kept_aside_and_saved_again(tmp_path: Path) -> None:
    recovery = tmp_path / "recovery"
    release = tmp_path / "release"
    job = LocalJob(
        WORKER,
        ["--release", str(release), "--limit", "150"],
        workers=2,
        node_timeout_s=2.0,
        workdir=tmp_path / "job",
        timeout_s=60,
        options=LocalJobOptions(env={"MS_RECOVERY_PATH": str(recovery)}, python=PYTHON),
    )
    job.start()
    try:
        job.wait_formed()
        for i in range(2):
            wait_until(lambda i=i: "allgather rank=" in job.log(i), 30, f"worker {i} gathered")
        state = recovery / STATE_FILE
        damaged = b"\x00garbage written behind the scheduler's lock\n"
        state.write_bytes(damaged)
        job.kill_worker(1)  # its failure, and the rejoin after it, must be saved
        job.restart_worker(1, wait=False)
        job.wait_status(
            lambda v: v.generation == 2 and job.everyone_back(v) and not v.save_error,
            "generation 2 saved and told",
        )
        payload = store.load(state, STATE_KIND)
        assert payload is not None
        assert int(payload["generation"]) == 2
        kept = sorted(recovery.glob(f"{STATE_FILE}.damaged-*"))
        assert len(kept) == 1, sorted(p.name for p in recovery.iterdir())
        assert kept[0].read_bytes() == damaged  # nothing the operator may want is lost
        scheduler_log = job.log(None)
        assert scheduler_log.count("the damaged file is kept as") == 1, scheduler_log
        assert f"the damaged file is kept as {kept[0]}" in scheduler_log, scheduler_log
        assert "saves the job's state there again" in scheduler_log
        wait_until(lambda: "rejoined rank=1" in job.log(1), 30, "the rejoin")
        release.touch()
        assert job.wait(60) == 0, [job.log(i) for i in (None, 0, 1)]
        assert "Traceback" not in "".join(job.log(i) for i in (None, 0, 1))
    finally:
        job.close()
