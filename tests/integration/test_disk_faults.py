"""A real full or read-only disk under MS_RECOVERY_PATH: nothing is told that is not on disk.

Each test mounts a small tmpfs (root; skipped with the reason otherwise, never in CI), fills it
with a filler file until the kernel says ENOSPC, and runs real processes on it.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest

from cluster.scheduler.persist import STATE_KIND
from cluster.storage import store
from cluster.storage.directory_store import STATE_FILE
from cluster.testing import free_port
from cluster.tools.testing import LocalJob, LocalJobOptions, wait_until
from tests import tmpfs
from tests.procs import PYTHON, ROOT, job_env, mscluster

WORKER = ROOT / "tests" / "integration" / "scripts" / "recovery_worker.py"
NODE_TIMEOUT_S = 2.0
NO_SPACE = "No space left on device"


def disk_generation(directory: Path) -> int:
    payload = store.load(directory / STATE_FILE, STATE_KIND)
    assert payload is not None
    return int(payload["generation"])


def generations_seen(log: str) -> set[int]:
    """Every generation a worker's output names (its own lines and the agent's)."""
    found = re.findall(r"generation[= ](\d+)", log)
    return {int(g) for g in found}


def start_job(tmp_path: Path, disk: Path) -> tuple[LocalJob, Path]:
    release = tmp_path / "release"
    job = LocalJob(
        WORKER,
        ["--release", str(release), "--limit", "150"],
        workers=2,
        node_timeout_s=NODE_TIMEOUT_S,
        workdir=tmp_path / "job",
        timeout_s=60,
        options=LocalJobOptions(env={"MS_RECOVERY_PATH": str(disk)}, python=PYTHON),
    )
    job.start()
    job.wait_formed()
    for i in range(2):
        wait_until(lambda i=i: "allgather rank=" in job.log(i), 30, f"worker {i} gathered")
    return job, release


def test_a_full_disk_holds_the_new_generation_back_until_space_returns(tmp_path: Path) -> None:
    with tmpfs.mounted("1m") as disk:
        job, release = start_job(tmp_path, disk)
        try:
            filler = tmpfs.fill(disk)
            job.kill_worker(1)  # its failure must be saved: it cannot be
            job.restart_worker(1, wait=False)
            # After the guard the scheduler takes it back in memory: generation 2 is decided...
            wait_until(
                lambda: "node '1' rejoined: generation 2" in job.log(None),
                30,
                "the rejoin decided by the scheduler",
            )
            # ...and held back: nobody hears of it, the disk still says generation 1.
            view = job.status()
            assert view.generation == 1
            assert NO_SPACE in view.save_error
            assert str(disk / STATE_FILE) in view.save_error
            assert view.unsaved_changes >= 1
            assert disk_generation(disk) == 1
            for i in range(2):
                assert generations_seen(job.log(i)) <= {1}, job.log(i)
            assert "rejoined rank=1" not in job.log(1)
            scheduler_log = job.log(None)
            assert scheduler_log.count("cannot save the recovery state") == 1, scheduler_log
            assert f"({NO_SPACE})" in scheduler_log
            table = mscluster("status", "--addr", job.address, secret_file=job.secret_file)
            assert "SAVES FAILING" in table.stdout, table.stdout + table.stderr
            assert "generation 1" in table.stdout
            filler.unlink()  # space returns: the retry lands and generation 2 goes out
            job.wait_status(
                lambda v: v.generation == 2 and job.everyone_back(v) and not v.save_error,
                "generation 2 told once saved",
            )
            assert disk_generation(disk) == 2
            wait_until(
                lambda: "rejoined rank=1 size=2 generation=2" in job.log(1), 30, "the rejoin"
            )
            wait_until(lambda: "generation 2" in job.log(0), 30, "the survivor's generation 2")
            assert "recovery state saved again" in job.log(None)
            # The failure: a restart resumed generation 1 while the workers were at 2.
            job.kill_scheduler()
            job.restart_scheduler()
            assert "generation 2" in job.log(None).split("resuming job", 1)[1].splitlines()[0]
            release.touch()
            assert job.wait(60) == 0, [job.log(i) for i in (None, 0, 1)]
            for i in range(2):
                assert "after rank=" in job.log(i)
                assert f"after rank={i} generation=2 result=[0, 1]" in job.log(i), job.log(i)
                assert generations_seen(job.log(i)) <= {1, 2}
            assert "Traceback" not in "".join(job.log(i) for i in (None, 0, 1))
        finally:
            job.close()


def test_a_scheduler_stopped_while_saves_fail_leaves_the_saved_state_to_resume(
    tmp_path: Path,
) -> None:
    with tmpfs.mounted("1m") as disk:
        job, release = start_job(tmp_path, disk)
        try:
            filler = tmpfs.fill(disk)
            job.kill_worker(1)  # a failure that cannot be saved
            assert job.scheduler is not None
            job.scheduler.signal(signal.SIGTERM)
            assert job.scheduler.popen.wait(15) == 1
            lines = [line for line in job.log(None).splitlines() if "not saved" in line]
            assert len(lines) == 1, job.log(None)
            assert f"{disk / STATE_FILE} is older than what this scheduler decided" in lines[0]
            assert NO_SPACE in lines[0]
            assert "Traceback" not in job.log(None)
            # Not told of the job's end (it is not on disk): the survivor waits for the
            # scheduler, as after a crash.
            assert job.worker(0).running
            assert "job failed" not in job.log(0)
            filler.unlink()
            job.restart_scheduler(wait=False)
            wait_until(lambda: "resuming job" in job.log(None), 30, "the resumed job")
            job.restart_worker(1)
            release.touch()
            assert job.wait(60) == 0, [job.log(i) for i in (None, 0, 1)]
        finally:
            job.close()


def scheduler_on(directory: Path, *, script: bool) -> subprocess.CompletedProcess[str]:
    """A scheduler started on `directory`, as `mscluster scheduler` or a training script."""
    env = job_env(
        2,
        free_port(),
        MS_ROLE="MS_SCHED",
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(directory),
    )
    command = [str(ROOT / "examples" / "allgather_check.py")] if script else ["-m", "cluster"]
    return subprocess.run(
        [PYTHON, *command, *([] if script else ["scheduler"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def assert_one_line(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.mark.parametrize("script", [False, True], ids=["mscluster", "script"])
def test_a_scheduler_on_a_full_disk_stops_with_one_line(script: bool) -> None:
    with tmpfs.mounted("256k") as disk:
        tmpfs.fill(disk)
        result = scheduler_on(disk, script=script)
        assert_one_line(result, f"MS_RECOVERY_PATH={str(disk)!r}", NO_SPACE)
        assert result.returncode == (1 if script else 2)


def test_a_scheduler_resuming_on_a_disk_that_filled_stops_with_one_line() -> None:
    with tmpfs.mounted("256k") as disk:
        env = job_env(
            2, free_port(), MS_ROLE="MS_SCHED", MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(disk)
        )
        first = subprocess.Popen(
            [PYTHON, "-m", "cluster", "scheduler"],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until((disk / STATE_FILE).exists, 30, "the first state saved")
        finally:
            first.send_signal(signal.SIGTERM)
            first.communicate(timeout=30)
        tmpfs.fill(disk)
        result = scheduler_on(disk, script=False)
        assert_one_line(result, "MS_RECOVERY_PATH is not usable", str(disk / STATE_FILE), NO_SPACE)


@pytest.mark.parametrize("script", [False, True], ids=["mscluster", "script"])
def test_a_scheduler_on_a_read_only_disk_stops_with_one_line(script: bool) -> None:
    with tmpfs.mounted("256k", read_only=True) as disk:
        result = scheduler_on(disk, script=script)
        assert_one_line(result, f"MS_RECOVERY_PATH={str(disk)!r}", "Read-only file system")


def test_a_worker_whose_node_file_cannot_be_written_says_so_once_and_goes_on(
    tmp_path: Path,
) -> None:
    with tmpfs.mounted("256k") as disk:
        tmpfs.fill(disk)
        port = free_port()
        env = job_env(1, port, MS_ENABLE_RECOVERY="1", MS_NODE_ID="0", MS_TOPO_TIMEOUT="30")
        example = str(ROOT / "examples" / "allgather_check.py")
        scheduler = subprocess.Popen(
            [PYTHON, example],
            env={**env, "MS_ROLE": "MS_SCHED", "MS_RECOVERY_PATH": str(tmp_path)},
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            worker = subprocess.run(
                [PYTHON, example],
                env={**env, "MS_ROLE": "MS_WORKER", "MS_RECOVERY_PATH": str(disk)},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        finally:
            scheduler.communicate(timeout=30)
        assert worker.returncode == 0, worker.stderr
        assert "allgather rank=0 size=1" in worker.stdout
        lines = [line for line in worker.stderr.splitlines() if NO_SPACE in line]
        assert len(lines) == 1, worker.stderr
        assert str(disk / "worker-0.json") in lines[0]
        assert "Traceback" not in worker.stderr


SAVE_AND_RETURN = str(ROOT / "tests" / "integration" / "scripts" / "save_and_return.py")


def assert_failed_of_the_write(result: subprocess.CompletedProcess[str], disk: Path) -> None:
    """Exit 1 with one `cluster: CheckpointError` line naming the file and the cause (and the
    writer's log line of it); nothing reported as held."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert "saved" in result.stdout
    lines = [line for line in result.stderr.splitlines() if "CheckpointError" in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("cluster: CheckpointError: cannot save the checkpoint of step 1 ")
    assert str(disk / "rank_0" / "model-00000001.ckpt") in lines[0]
    assert NO_SPACE in lines[0]
    logged = [line for line in result.stderr.splitlines() if "checkpoint-writer-model" in line]
    assert len(logged) == 1, result.stderr
    assert NO_SPACE in logged[0]
    assert "Traceback" not in result.stderr
    assert [p.name for p in (disk / "rank_0").iterdir()] == [".model.lock"]  # the manager's


def test_a_program_that_returns_after_a_save_the_disk_refuses_exits_1() -> None:
    """No job, no flush(): the write fails after the program returned, and still ends it."""
    with tmpfs.mounted("256k") as disk:
        result = subprocess.run(
            [PYTHON, SAVE_AND_RETURN, str(disk)],
            env=job_env(1, free_port()),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert_failed_of_the_write(result, disk)


def test_a_worker_that_returns_after_a_save_the_disk_refuses_fails_the_job() -> None:
    """In a job, the finalize at exit waits for the write and tells the scheduler the worker
    failed of it, instead of finished."""
    with tmpfs.mounted("256k") as disk:
        env = job_env(1, free_port(), MS_NODE_ID="0", MS_TOPO_TIMEOUT="30")
        scheduler = subprocess.Popen(
            [PYTHON, SAVE_AND_RETURN, str(disk), "--job"],
            env={**env, "MS_ROLE": "MS_SCHED"},
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            worker = subprocess.run(
                [PYTHON, SAVE_AND_RETURN, str(disk), "--job"],
                env={**env, "MS_ROLE": "MS_WORKER"},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        finally:
            _, scheduler_err = scheduler.communicate(timeout=30)
        assert_failed_of_the_write(worker, disk)
        assert scheduler.returncode == 1, scheduler_err
        assert "CheckpointError: cannot save the checkpoint of step 1" in scheduler_err
