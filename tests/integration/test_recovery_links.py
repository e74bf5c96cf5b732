"""Links planted in a recovery path never make a root job write where they point (issue 25).

Another local user (uid 65534, nobody) plants symbolic links in a world-writable (1777)
MS_RECOVERY_PATH at every name the job writes, the old predictable temporaries included, each
pointing at a root-owned file outside. The scheduler and the workers, running as root, refuse
the directory with one line and leave the files alone. Then the same links, left in a directory
that passes the check (made before someone fixed its mode), are refused or replaced, never
followed: the job runs to its end and the files are unchanged.

Needs root (to run the job as root and plant as another user); skipped with the reason
otherwise, and never skipped in CI (CLUSTER_REQUIRE_SERVERS=1).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.storage import atomic
from cluster.tools.testing import LocalJob, LocalJobOptions, wait_until
from tests.procs import PYTHON, ROOT
from tests.servers import require

WORKER = ROOT / "tests" / "integration" / "scripts" / "recovery_worker.py"
NOBODY = 65534
GUESSED_PIDS = 300  # the attacker plants a temporary for each of the next pids
NAMES = ("scheduler.json", "kv.log", "worker-0.json", "worker-1.json")
FIXED = ("scheduler.lock", "kv.log")  # names the job opens in place


@pytest.fixture
def as_root() -> None:
    require(None if os.geteuid() == 0 else "running a job as root beside another user needs root")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory like /tmp: root's, mode 1777, that any user can reach."""
    path = Path(tempfile.mkdtemp(prefix="cluster-shared-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", str(path)], check=False, timeout=30)


def targets(outside: Path) -> dict[str, Path]:
    """One root-owned file outside the recovery path per planted name, 0644."""
    outside.mkdir(mode=0o755, exist_ok=True)
    made = {}
    for name in (*FIXED, *NAMES):
        target = outside / f"target-{name}"
        target.write_text(f"root's own {name}\n")
        target.chmod(0o644)
        made[name] = target
    return made


def plants(directory: Path, aims: dict[str, Path]) -> dict[str, str]:
    """Link name -> where it points: the files the job opens in place and the temporaries of
    the old scheme (`.NAME.<pid>.tmp`) for the next pids."""
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    links = {name: str(aims[name]) for name in FIXED}
    for name in NAMES:
        for pid in range(last + 1, last + 1 + GUESSED_PIDS):
            links[atomic.temporary_name(directory / name, str(pid)).name] = str(aims[name])
    return links


def plant_as(uid: int | None, directory: Path, links: dict[str, str]) -> None:
    """Make `links` in `directory` from a forked child running as `uid` (None: as this
    process's user)."""
    child = os.fork()
    if child == 0:  # pragma: no cover - the child only plants and exits
        code = 1
        try:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            for name, aim in links.items():
                os.symlink(aim, directory / name)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "planting the links failed"


def contents(files: dict[str, Path]) -> dict[str, tuple[bytes, int, int]]:
    return {
        name: (path.read_bytes(), path.stat().st_mode, path.stat().st_mtime_ns)
        for name, path in files.items()
    }


def job_on(directory: Path, tmp_path: Path) -> LocalJob:
    return LocalJob(
        WORKER,
        ["--release", str(tmp_path / "release"), "--limit", "60"],
        workers=2,
        node_timeout_s=3.0,
        workdir=tmp_path / "job",
        timeout_s=60,
        options=LocalJobOptions(env={"MS_RECOVERY_PATH": str(directory)}, python=PYTHON),
    )


def test_a_world_writable_recovery_path_is_refused_and_nothing_is_followed(
    as_root: None, shared: Path, tmp_path: Path
) -> None:
    aims = targets(tmp_path / "outside")
    before = contents(aims)
    plant_as(NOBODY, shared, plants(shared, aims))
    with job_on(shared, tmp_path) as job:
        assert job.wait(60) != 0
    for log in (job.log(None), job.log(0), job.log(1)):
        lines = [line for line in log.splitlines() if "MS_RECOVERY_PATH" in line]
        assert len(lines) == 1, log
        assert f"MS_RECOVERY_PATH={str(shared)!r} can be written by users" in lines[0]
        assert "mode 1777, owner uid 0 (root)" in lines[0]
        assert f"mkdir -m 700 {shared}/JOB" in lines[0]
        assert "Traceback" not in log
    assert contents(aims) == before
    assert not [p for p in shared.iterdir() if not p.is_symlink()]  # nothing written there


def test_links_left_in_a_safe_directory_are_replaced_never_followed(
    as_root: None, tmp_path: Path
) -> None:
    directory = tmp_path / "recovery"
    directory.mkdir(mode=0o700)
    aims = targets(tmp_path / "outside")
    before = contents(aims)
    links = plants(directory, aims)
    del links["scheduler.lock"]  # that one stops the job: see the next test
    plant_as(None, directory, links)
    with job_on(directory, tmp_path) as job:
        job.wait_formed()
        for i in range(2):
            wait_until(lambda i=i: "allgather rank=" in job.log(i), 30, f"worker {i} gathered")
        (tmp_path / "release").touch()
        assert job.wait(60) == 0, job.log(None)
    assert contents(aims) == before
    left = sorted(p.name for p in directory.iterdir())
    assert not [name for name in left if (directory / name).is_symlink()], left
    assert {"scheduler.json", "kv.log", "worker-0.json", "worker-1.json"} <= set(left)


def test_a_link_at_the_lock_stops_the_scheduler_with_one_line(
    as_root: None, tmp_path: Path
) -> None:
    directory = tmp_path / "recovery"
    directory.mkdir(mode=0o700)
    aims = targets(tmp_path / "outside")
    before = contents(aims)
    (directory / "scheduler.lock").symlink_to(aims["scheduler.lock"])
    with job_on(directory, tmp_path) as job:
        scheduler = job.scheduler
        assert scheduler is not None
        assert scheduler.wait(60) != 0
    said = [line for line in job.log(None).splitlines() if "scheduler.lock" in line]
    assert said == [
        f"cluster: ConfigError: {directory / 'scheduler.lock'} is a symbolic link: it was not "
        "made by this job, and is never followed; remove it, and let only the job's user "
        f"write MS_RECOVERY_PATH={str(directory)!r}"
    ]
    assert contents(aims) == before
