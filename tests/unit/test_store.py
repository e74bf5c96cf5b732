"""cluster.store: atomic, versioned, checksummed recovery files, and the recovery-path lock."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.protocol.errors import ConfigError, FencedError, StateFileError
from cluster.scheduler import descriptors
from cluster.storage import atomic, store
from cluster.testing import free_port
from tests.procs import MSCLUSTER, ROOT, as_a_user, job_env

PAYLOAD = {"job_id": "abc", "generation": 3, "nodes": [{"node_id": "0", "rank": 0}]}


def test_save_then_load_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.json"
    store.save(path, "scheduler", PAYLOAD)
    assert store.load(path, "scheduler") == PAYLOAD
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in tmp_path.iterdir()] == ["scheduler.json"]  # no temporary left


def test_missing_file_is_none(tmp_path: Path) -> None:
    assert store.load(tmp_path / "nothing.json", "scheduler") is None


def test_save_replaces_the_previous_state(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    store.save(path, "scheduler", PAYLOAD)
    store.save(path, "scheduler", {**PAYLOAD, "generation": 4})
    loaded = store.load(path, "scheduler")
    assert loaded is not None
    assert loaded["generation"] == 4


@pytest.mark.parametrize("keep", [0, 1, 10, 0.5])
def test_truncated_file_is_reported_not_loaded(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "s.json"
    store.save(path, "scheduler", PAYLOAD)
    data = path.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep
    path.write_bytes(data[:cut])
    with pytest.raises(StateFileError, match=r"truncated or corrupt.*move the whole"):
        store.load(path, "scheduler")
    assert path.read_bytes() == data[:cut]  # reading never rewrites


def test_edited_payload_fails_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    store.save(path, "scheduler", PAYLOAD)
    envelope = json.loads(path.read_text())
    envelope["payload"]["generation"] = 99
    path.write_text(json.dumps(envelope))
    with pytest.raises(StateFileError, match="fails its checksum"):
        store.load(path, "scheduler")


def test_newer_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    store.save(path, "scheduler", PAYLOAD)
    envelope = json.loads(path.read_text())
    envelope["version"] = store.VERSION + 1
    path.write_text(json.dumps(envelope))
    with pytest.raises(StateFileError, match=rf"format version {store.VERSION + 1}"):
        store.load(path, "scheduler")


def test_foreign_file_and_other_kind_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"hello": "world"}))
    with pytest.raises(StateFileError, match="not a cluster recovery state"):
        store.load(path, "scheduler")
    store.save(path, "worker", PAYLOAD)
    with pytest.raises(StateFileError, match="of a 'worker', not of a 'scheduler'"):
        store.load(path, "scheduler")


def test_a_failed_save_leaves_the_old_state_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.json"
    store.save(path, "scheduler", PAYLOAD)
    before = path.read_bytes()

    def broken_replace(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(StateFileError, match="previous state, if any, is unchanged"):
        store.save(path, "scheduler", {**PAYLOAD, "generation": 5})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


def test_a_save_whose_directory_sync_fails_says_the_new_state_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory's fsync fails (an I/O error) once the rename landed: the error says the
    new state is there but not known durable (so the save counts as failed), not that the
    previous state is unchanged."""
    path = tmp_path / "s.json"
    store.save(path, "scheduler", PAYLOAD)
    newer = {**PAYLOAD, "generation": 5}

    def failing(directory: Path) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(atomic, "fsync_directory", failing)
    with pytest.raises(StateFileError) as info:
        store.save(path, "scheduler", newer)
    assert "the new state is in place, but syncing its directory failed" in str(info.value)
    assert "unchanged" not in str(info.value)
    assert store.load(path, "scheduler") == newer


def test_a_killed_writer_never_leaves_a_half_file(tmp_path: Path) -> None:
    """SIGKILL a process in the middle of many saves: the file is always whole."""
    path = tmp_path / "s.json"
    script = (
        "import sys; from pathlib import Path; from cluster.storage import store\n"
        "p = Path(sys.argv[1])\n"
        "for i in range(100000):\n"
        "    store.save(p, 'scheduler', {'i': i, 'pad': 'x' * 20000})\n"
        "    if i == 5: print('saving', flush=True)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True
    ) as writer:
        try:
            assert writer.stdout is not None
            assert writer.stdout.readline().strip() == "saving"
        finally:
            writer.kill()
            writer.wait(10)
    loaded = store.load(path, "scheduler")
    assert loaded is not None
    assert loaded["i"] >= 5


def test_one_scheduler_per_recovery_path(tmp_path: Path) -> None:
    first = store.RecoveryLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(ConfigError, match=rf"pid {os.getpid()}.*cannot share a recovery path"):
            store.RecoveryLock(tmp_path).acquire()
    finally:
        first.release()
    with store.RecoveryLock(tmp_path):  # free again once released
        pass


SAVER = """
import sys
from pathlib import Path
from cluster.storage import store
path = Path(sys.argv[1])
for count in range(1, 100_000):
    # Large enough that a write takes a while, so kills land inside writes too.
    store.save(path, "scheduler", {"count": count, "padding": "x" * 200_000})
    print(count, flush=True)
"""


@pytest.mark.parametrize("seed", range(12))
def test_sigkill_at_a_random_moment_leaves_the_last_completed_save(
    tmp_path: Path, seed: int
) -> None:
    """A real process saving in a loop is SIGKILLed after a random number of saves: the file
    holds a complete save, at least the last one the process reported done."""
    path = tmp_path / "scheduler.json"
    saver = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert saver.stdout is not None
    target = 3 + (seed * 7919) % 40
    try:
        for _ in range(target):
            line = saver.stdout.readline()
            assert line, "the saver stopped early"
        done = int(line)
    finally:
        saver.kill()
        saver.wait(10)
        saver.stdout.close()
    loaded = store.load(path, "scheduler")
    assert loaded is not None
    assert loaded["count"] >= done
    assert len(loaded["padding"]) == 200_000
    store.save(path, "scheduler", {"count": 0})  # the next save clears the killed one's litter
    assert [p.name for p in tmp_path.iterdir()] == ["scheduler.json"]


@pytest.mark.parametrize("there", ["a directory", "a file of mode 0"])
def test_a_lock_file_the_scheduler_cannot_open_says_what_is_there_and_what_to_do(
    tmp_path: Path, there: str
) -> None:
    """A real scheduler started where scheduler.lock is a directory, or a file of mode 0 (run
    as a user whom the mode keeps out): its one line says what is there and what to do, not to
    free space (what it says of a full disk), and the scheduler does not start."""
    directory = tmp_path / "job"
    directory.mkdir(mode=0o700)
    lock = directory / store.LOCK_NAME
    as_user: list[str] = []
    if there == "a directory":
        lock.mkdir()
        expected = (
            f"{lock} is a directory, where the scheduler keeps its lock file: move it out of "
            f"MS_RECOVERY_PATH={str(directory)!r}, then start the scheduler again"
        )
    else:
        as_user = as_a_user()
        lock.touch(mode=0)
        expected = (
            f"this process may not open {lock}, the scheduler's lock file, for reading and "
            "writing (Permission denied): give the job's user read and write permission on it "
            f"(chmod 600 {lock}), or remove it (the scheduler makes it again)"
        )
    env = job_env(
        1, free_port(), MS_ROLE="MS_SCHED", MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(directory)
    )
    done = subprocess.run(
        [*as_user, *MSCLUSTER, "scheduler"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"mscluster: ConfigError: {expected}"], done.stderr
    assert sorted(p.name for p in directory.iterdir()) == [store.LOCK_NAME]


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_that_refuses_locks_is_one_clear_error_and_leaks_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """NFSv3 without lockd answers flock with ENOLCK (some file systems, EOPNOTSUPP): this
    machine cannot, so flock is made to."""

    def refuse(fd: int, operation: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", refuse)
    before = descriptors.open_descriptors()
    with pytest.raises(ConfigError) as caught:
        store.RecoveryLock(tmp_path).acquire()
    assert descriptors.open_descriptors() == before
    message = str(caught.value)
    assert f"MS_RECOVERY_PATH={str(tmp_path)!r}" in message
    assert f"({os.strerror(code)})" in message
    assert "a local directory" in message
    assert "CLUSTER_STATE_URL" in message


def a_flock_that_replaces_the_lock_file_first(
    monkeypatch: pytest.MonkeyPatch, directory: Path, times: int
) -> None:
    """The directory's lock file removed (its directory replaced) between the lock's open and
    its flock, the first `times` times: a race made certain, with real files and real locks."""
    real = fcntl.flock
    left = [times]

    def flock(fd: int, operation: int) -> None:
        if left[0] > 0 and operation & fcntl.LOCK_EX:
            left[0] -= 1
            (directory / store.LOCK_NAME).unlink()
        real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)


def test_a_lock_file_replaced_while_it_is_locked_is_locked_again_at_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a_flock_that_replaces_the_lock_file_first(monkeypatch, tmp_path, times=1)
    with store.RecoveryLock(tmp_path) as lock:
        lock.check()  # the file the path names is the one locked
        with pytest.raises(ConfigError, match="another scheduler"):
            store.RecoveryLock(tmp_path).acquire()


def test_a_lock_file_replaced_again_and_again_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a_flock_that_replaces_the_lock_file_first(monkeypatch, tmp_path, times=2)
    before = descriptors.open_descriptors()
    with pytest.raises(ConfigError) as caught:
        store.RecoveryLock(tmp_path).acquire()
    assert descriptors.open_descriptors() == before
    assert str(caught.value) == (
        f"{tmp_path / store.LOCK_NAME} was replaced twice while this scheduler locked it: "
        f"something removes or replaces MS_RECOVERY_PATH={str(tmp_path)!r}; stop it, then "
        "start the scheduler again"
    )


def test_a_lock_whose_directory_is_removed_says_so(tmp_path: Path) -> None:
    directory = tmp_path / "job"
    directory.mkdir()
    with store.RecoveryLock(directory) as lock:
        lock.check()
        directory.rename(tmp_path / "old")
        with pytest.raises(FencedError, match=r"was removed or replaced .*\(scheduler.lock"):
            lock.check()
        directory.mkdir()
        second = store.RecoveryLock(directory)  # a second scheduler, on the directory made again
        with second, pytest.raises(FencedError, match="another scheduler may run on it now"):
            lock.check()
