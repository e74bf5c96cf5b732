"""cluster.tools.launch_lock: a log directory's lock, with real files and real `flock`s (two
open files of one process conflict as two processes do); a file system without locks is
`flock` made to refuse (ENOLCK), which this machine cannot."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from cluster.protocol.errors import ConfigError
from cluster.storage import atomic, holder_lock
from cluster.tools import launch_lock
from cluster.tools.launch_lock import LOCK_FILE, LogDirLock


def test_the_holder_is_written_and_a_second_lock_is_refused_naming_it(tmp_path: Path) -> None:
    first = LogDirLock(tmp_path)
    assert first.take(29611) == ""
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert holder == {"pid": os.getpid(), "host": socket.gethostname(), "port": 29611}
    with pytest.raises(ConfigError) as refused:
        LogDirLock(tmp_path).take(29612)
    assert str(refused.value) == (
        f"--log-dir {str(tmp_path)!r} is in use by another mscluster run (pid {os.getpid()} on "
        "this host, --master-port 29611), whose job secret, pids and logs this run would "
        "replace: give this job another --log-dir, or stop that job first"
    )
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == holder  # the refused wrote nothing
    first.release()
    second = LogDirLock(tmp_path)
    assert second.take(29612) == ""  # the file stays; the lock went with its holder
    assert json.loads((tmp_path / LOCK_FILE).read_text())["port"] == 29612
    second.release()
    assert (tmp_path / LOCK_FILE).exists()


def test_a_holder_on_another_host_or_not_written_yet_is_said_so(tmp_path: Path) -> None:
    """A holder on another host shares the directory through a shared file system (NFS with
    its locks), most often as another host of the same job: the refusal says that each host
    needs a log directory of its own, and how to give one."""
    path = tmp_path / LOCK_FILE
    path.write_text('{"pid": 7, "host": "node12", "port": 8118}\n')
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(ConfigError) as refused:
            LogDirLock(tmp_path).take(1)
        assert str(refused.value) == (
            f"--log-dir {str(tmp_path)!r} is in use by the mscluster run of another host (pid 7 "
            "on host node12, --master-port 8118): the directory is shared by the hosts, and "
            "each host's part of a job writes its own job secret, pids and logs: give each host "
            f"a --log-dir of its own (e.g. --log-dir {tmp_path}/node<rank>; without --log-dir, "
            "a job that spans hosts keeps each host's part in logs/node<rank>/)"
        )
        os.ftruncate(fd, 0)  # locked, its holder not written yet
        with pytest.raises(ConfigError, match=r"\(whose pid and host are not written yet\)"):
            LogDirLock(tmp_path).take(1)
    finally:
        os.close(fd)


def test_a_linked_lock_file_is_refused_and_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("someone's file\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / LOCK_FILE).symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        LogDirLock(logs).take(1)
    os.unlink(logs / LOCK_FILE)
    os.link(elsewhere, logs / LOCK_FILE)
    with pytest.raises(ConfigError, match=r"is a file with 2 names \(a hard link\)"):
        LogDirLock(logs).take(1)
    assert elsewhere.read_text() == "someone's file\n"


def test_a_file_system_without_locks_goes_on_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = LogDirLock(tmp_path)
    said = lock.take(1)
    assert said == (
        f"mscluster: --log-dir {str(tmp_path)!r} cannot be locked (its file system refuses a "
        f"lock on {LOCK_FILE}: No locks available): nothing keeps another mscluster run out of "
        "it; give every job its own --log-dir"
    )
    lock.release()  # none held: nothing to let go


def test_a_refused_run_removes_nothing_of_the_holders(tmp_path: Path) -> None:
    """`release(remove=True)` (a run refused in a directory it made) removes the lock file only
    while it holds it: two runs started at once in a directory neither found, the refused one
    removed the holder's file, and a third run could then lock a new one beside the holder."""
    first = LogDirLock(tmp_path)
    assert first.take(1) == ""
    refused = LogDirLock(tmp_path)
    with pytest.raises(ConfigError, match="is in use by another mscluster run"):
        refused.take(2)
    refused.release(remove=True)
    assert (tmp_path / LOCK_FILE).exists()  # the holder's, which keeps a third run out
    with pytest.raises(ConfigError, match=r"--master-port 1\)"):
        LogDirLock(tmp_path).take(3)
    first.release(remove=True)  # held: removed, before its lock is let go
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_file_removed_as_it_is_locked_is_taken_on_the_path_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flock on a file removed between its open and its lock: another run made the file there
    anew and holds it (one that locks the file alone: a launcher whose file system locks no
    directory). This run is refused, naming it, instead of holding a lock on a file no one else
    can reach."""
    others: list[holder_lock.Hold] = []
    real_open_own = atomic.open_own

    def open_then_lose(where: Path) -> tuple[int | None, str]:
        opened = real_open_own(where)
        if not others:  # the first open only: a run that locks the file alone (see below)
            where.unlink()
            others.append(holder_lock.Hold(where, port=8118))
            assert others[0].open_and_lock() is None
        return opened

    monkeypatch.setattr(atomic, "open_own", open_then_lose)
    with pytest.raises(
        ConfigError, match=r"another mscluster run \(pid \d+ on this host, --master-port 8118\)"
    ):
        LogDirLock(tmp_path).take(1)
    others[0].release()


def test_a_holder_whose_lock_file_was_removed_says_so_and_locks_the_file_there_anew(
    tmp_path: Path,
) -> None:
    """Removed while held: the next `keep` says so and locks a new file, which keeps later
    runs out. Replaced by one another run holds (one that locks the file alone): said once,
    the job going on; once that run is gone, said that this run holds it again."""
    path = tmp_path / LOCK_FILE
    first = LogDirLock(tmp_path)
    assert first.take(1) == ""
    path.unlink()
    assert first.keep() == (
        f"mscluster: {str(path)!r} was removed or replaced while this run held it, so it kept "
        "no other launcher out: locked the file there anew"
    )
    assert first.keep() == ""
    with pytest.raises(ConfigError, match=r"--master-port 1\)"):
        LogDirLock(tmp_path).take(2)
    path.unlink()
    other = holder_lock.Hold(path, port=2)  # a run that locks the file alone, as above
    assert other.open_and_lock() is None
    said = first.keep()
    assert said.startswith(
        f"mscluster: {str(path)!r} was removed or replaced while this run held it, and another "
        f"mscluster run (pid {os.getpid()} on this host, --master-port 2) has locked the file "
        "there since: this job goes on, but the two runs replace each other's job secret, pids "
        f"and logs in --log-dir {str(tmp_path)!r}; stop one of them"
    ), said
    assert first.keep() == ""  # said once
    other.release()
    assert first.keep() == f"mscluster: this run holds {str(path)!r} again"
    assert json.loads(path.read_text())["port"] == 1
    first.release()


def test_a_newcomer_is_refused_by_the_directory_whatever_became_of_the_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder's `launcher.lock` removed, or replaced by a file naming no one, before it
    checked: a newcomer is refused by the directory's own lock, before it makes or writes
    anything there, naming the holder once its file names it again."""
    monkeypatch.setattr(launch_lock, "CHECK_S", 0.0)  # the refusal waits SETTLE_S for a name
    path = tmp_path / LOCK_FILE
    first = LogDirLock(tmp_path)
    assert first.take(1) == ""
    path.unlink()
    with pytest.raises(ConfigError) as refused:
        LogDirLock(tmp_path).take(2)
    assert str(refused.value) == (
        f"--log-dir {str(tmp_path)!r} is in use by another mscluster run (which holds the "
        f"directory; its {LOCK_FILE} was removed or replaced since and names no one), whose job "
        "secret, pids and logs this run would replace: give this job another --log-dir, or "
        "stop that job first"
    )
    assert sorted(tmp_path.iterdir()) == []  # made nothing
    stale = json.dumps({"pid": _reaped_pid(), "host": socket.gethostname(), "port": 9}) + "\n"
    path.write_text(stale)  # an old run's copy, naming a process that ended
    with pytest.raises(ConfigError, match="names no one"):
        LogDirLock(tmp_path).take(2)
    assert path.read_text() == stale  # wrote nothing
    assert first.keep().endswith("locked the file there anew")
    with pytest.raises(ConfigError, match=rf"\(pid {os.getpid()} on this host, --master-port 1\)"):
        LogDirLock(tmp_path).take(2)
    first.release()
    second = LogDirLock(tmp_path)
    assert second.take(2) == ""  # the directory's lock went with its holder too
    second.release()


def _reaped_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid
