"""One CheckpointManager per rank directory and prefix, with real processes: a second process
is refused with a message naming the directory, the prefix and the holder while the first
holds the lock, and takes it at once after the first is SIGKILLed (or waits for a predecessor
still exiting); in one process, a manager closed or dropped lets the next one in; a forked child
never keeps the lock; a planted file is refused; a file system without locks is said once."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol.errors import CheckpointError, JobTimeoutError
from cluster.storage import checkpoint_lock, holder_lock
from cluster.testing import Process, wait_until
from tests import tmpfs
from tests.procs import PYTHON, Procs, job_env

# Holds rank 0's checkpoints of prefix 'mlp' under argv[1] (one saved) until it is killed;
# with --fork, after forking a child that lives on (a data loader's worker).
HOLDER = """
import os, sys, threading
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager

ckpt = CheckpointManager(sys.argv[1], "mlp", CheckpointConfig(), rank=0, recovery=False)
ckpt.save(1, {"step": 1})
ckpt.flush()
if "--fork" in sys.argv:
    child = os.fork()
    if child == 0:
        threading.Event().wait(600)
        os._exit(0)
    print("forked", child, flush=True)
print("holding", flush=True)
threading.Event().wait(600)
"""


def holder(processes: Procs, directory: Path, *flags: str) -> Process:
    proc = processes.start("holder", [PYTHON, "-c", HOLDER, str(directory), *flags], job_env(1, 0))
    proc.wait_for_output("holding", 30)
    return proc


def mlp(directory: Path, prefix: str = "mlp", **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("rank", 0)
    return CheckpointManager(directory, prefix, CheckpointConfig(), recovery=False, **kwargs)


def test_a_second_process_is_refused_while_the_first_holds_it_and_takes_it_once_it_is_killed(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs given one directory and prefix: the second is refused (after its wait) with a
    line naming the directory, the prefix and the holder, and leaves the first's files alone.
    The first SIGKILLed, the kernel has released its lock: taken without any wait."""
    directory = tmp_path / "ckpt"
    first = holder(processes, directory)
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.2)
    with pytest.raises(CheckpointError) as refused:
        mlp(directory)
    message = str(refused.value)
    assert f"the checkpoints of prefix 'mlp' in {directory / 'rank_0'} are in use" in message
    host = socket.gethostname()
    assert f"(pid {first.pid} on host {host}, this host, which holds .mlp.lock; " in message
    assert "waited 0.2 s for it to end" in message
    assert message.endswith(
        "give each job its own checkpoint directory or prefix, or stop the other process"
    )
    assert (directory / "rank_0" / "mlp-00000001.ckpt").exists()
    first.signal(signal.SIGKILL)
    first.wait(10)
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.0)  # at once, or refused
    with mlp(directory) as restarted:
        assert restarted.load(1) == {"step": 1}
        restarted.save(2, {"step": 2})
        restarted.flush()
        assert restarted.steps() == [1, 2]


def test_a_newcomer_waits_for_a_predecessor_still_exiting(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A promoted spare on the host of a failed worker that is still ending: it says it waits,
    and takes the lock as soon as the predecessor is gone."""
    directory = tmp_path / "ckpt"
    first = holder(processes, directory)
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 60.0)
    made: list[CheckpointManager | BaseException] = []

    def make() -> None:
        try:
            made.append(mlp(directory))
        except BaseException as exc:
            made.append(exc)

    with caplog.at_level(logging.INFO, logger="cluster.storage.checkpoint_lock"):
        thread = threading.Thread(target=make)
        thread.start()
        try:
            waiting = f"CheckpointManager (pid {first.pid} on host "

            def said() -> bool:
                return any(waiting in r.getMessage() for r in caplog.records)

            wait_until(said, 30, "the newcomer to say it waits")
            assert "waiting up to 60 s for it to end" in caplog.records[-1].getMessage()
            first.signal(signal.SIGKILL)
        finally:
            thread.join(60)
    assert not thread.is_alive()
    newcomer = made[0]
    assert isinstance(newcomer, CheckpointManager), newcomer
    assert newcomer.steps() == [1]
    newcomer.close()


def test_a_forked_child_of_the_holder_does_not_keep_the_lock(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "ckpt"
    first = holder(processes, directory, "--fork")
    child = int(first.output.split("forked ", 1)[1].split()[0])
    try:
        first.signal(signal.SIGKILL)
        first.wait(10)
        assert Path(f"/proc/{child}").exists()  # the child lives on
        monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.0)
        mlp(directory).close()
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_child_forked_while_another_thread_is_in_the_registry_can_lock(tmp_path: Path) -> None:
    """A fork while another thread of the parent holds the lock of the registry of held files
    (a manager being made or closed there): the child has no such thread, and its first manager
    must not wait for it forever."""
    inside, leave = threading.Event(), threading.Event()

    def in_the_registry() -> None:
        with holder_lock._registry_lock:
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=in_the_registry)
    thread.start()
    try:
        assert inside.wait(10)
        child = os.fork()
        if child == 0:  # the child: lock a directory of its own, say whether it holds it
            lock = checkpoint_lock.CheckpointLock(tmp_path, "mlp")
            lock.acquire(wait_s=0.0)
            os._exit(0 if lock.held else 1)
        ended: list[int] = []

        def reaped() -> bool:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                ended.append(os.waitstatus_to_exitcode(status))
            return bool(pid)

        with contextlib.suppress(JobTimeoutError):
            wait_until(reaped, 10, "the forked child to end")
        if not ended:  # it waits for the registry's lock: it never ends by itself
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    finally:
        leave.set()
        thread.join(10)
    assert ended == [0], "the forked child waited for the registry's lock forever"


def test_in_one_process_a_manager_closed_or_dropped_lets_the_next_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second manager of one rank and prefix is refused at once (nothing to wait for);
    another prefix or another rank in the same directory is independent."""
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 60.0)  # not waited for in one process
    first = mlp(tmp_path)
    first.save(1, {"step": 1})
    ours = r"in use by another CheckpointManager of this process \(pid \d+\): .*close\(\) that"
    with pytest.raises(CheckpointError, match=ours):
        mlp(tmp_path)
    ema = mlp(tmp_path, "mlp-ema")
    other_rank = mlp(tmp_path, rank=1)
    first.close()
    second = mlp(tmp_path)
    assert second.steps() == [1]
    with pytest.raises(CheckpointError, match=ours):
        first.steps()  # used again, a closed manager takes the lock again: second holds it
    del second  # dropped without close(): its lock goes with it
    assert first.steps() == [1]
    first.close()
    ema.close()
    other_rank.close()


def test_a_manager_made_before_init_locks_only_the_rank_it_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every worker of a host may make its manager before cluster.init() (rank 0 until then):
    none takes rank 0's lock before it uses the files as rank 0."""
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.0)
    early = [mlp(tmp_path, rank=None) for _ in range(3)]
    assert early[0].rank == 0
    early[0].save(1, {"step": 1})  # used outside a job: rank 0's files, locked now
    with pytest.raises(CheckpointError, match="of this process"):
        early[1].steps()
    for manager in early:
        manager.close()


@pytest.mark.parametrize("planted", ["symlink", "hardlink"])
def test_a_planted_lock_file_is_refused_and_never_written(tmp_path: Path, planted: str) -> None:
    rank_dir = tmp_path / "rank_0"
    rank_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("precious\n")
    if planted == "symlink":
        (rank_dir / ".mlp.lock").symlink_to(elsewhere)
        why = "is a symbolic link"
    else:
        os.link(elsewhere, rank_dir / ".mlp.lock")
        why = "is a file with 2 names"
    with pytest.raises(CheckpointError, match=f"{rank_dir / '.mlp.lock'} {why}.*remove it"):
        mlp(tmp_path)
    assert elsewhere.read_text() == "precious\n"


@pytest.mark.parametrize("planted", ["directory", "socket"])
def test_a_directory_or_socket_at_the_lock_path_is_refused_not_gone_on_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, planted: str
) -> None:
    """What cannot even be opened as a file is planted too: refused as a FIFO is, never taken
    for a file system without locks (the manager would go on unlocked beside another)."""
    rank_dir = tmp_path / "rank_0"
    rank_dir.mkdir()
    if planted == "directory":
        (rank_dir / ".mlp.lock").mkdir()
    else:
        monkeypatch.chdir(rank_dir)  # a socket's path is short: bound by its relative name
        server = socket.socket(socket.AF_UNIX)
        server.bind(".mlp.lock")
        server.close()
    why = f"{rank_dir / '.mlp.lock'} is not a regular file: it was not made by a Checkpoint"
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError, match=why):
        mlp(tmp_path)
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def planted_by_another_user(path: Path) -> None:
    """Give `path` to another user (nobody), as a file planted there by that user is."""
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534, follow_symlinks=False)


def test_a_fifo_planted_at_the_lock_path_never_blocks_the_holder(tmp_path: Path) -> None:
    """The holder in a job reads the file for a successor's claim before each write: a FIFO
    put in its place (the file removed, the rank directory writable by another user) is not a
    claim, and is neither waited on nor read."""
    lock = checkpoint_lock.CheckpointLock(tmp_path, "mlp")
    lock.acquire(seat=EARLIER)
    assert lock.held
    path = tmp_path / ".mlp.lock"
    path.unlink()
    os.mkfifo(path)
    planted_by_another_user(path)
    read: list[object] = []
    reader = threading.Thread(target=lambda: read.append(lock.displaced()), daemon=True)
    reader.start()
    reader.join(10)
    blocked = reader.is_alive()
    if blocked:  # a writer opens the FIFO: the blocked open and read end
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
    lock.release()
    assert not blocked, "displaced() blocked opening the FIFO"
    assert read == [None]


# Holds the lock of argv[1] in a job, then a file of argv[2] bytes (holes: nothing on disk) of
# another user is put in its place; reads the claim with at most 256 MiB more address space.
LARGE = """
import os, resource, sys
from pathlib import Path
from cluster.storage.checkpoint_lock import CheckpointLock, Seat

directory = Path(sys.argv[1])
lock = CheckpointLock(directory, "mlp")
lock.acquire(seat=Seat("0a1b2c3d4e5f", "1", 11, 1))
path = directory / ".mlp.lock"
path.unlink()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
os.ftruncate(fd, int(sys.argv[2]))
os.close(fd)
if os.geteuid() == 0:
    os.chown(path, 65534, 65534)
with open("/proc/self/statm") as statm:
    used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), resource.RLIM_INFINITY))
print("displaced:", lock.displaced(), flush=True)
"""


def test_a_large_file_planted_at_the_lock_path_is_not_read(tmp_path: Path) -> None:
    """A file of 8 GiB in the lock file's place: reading it whole would take 8 GiB of memory."""
    done = subprocess.run(
        [PYTHON, "-c", LARGE, str(tmp_path), str(8 << 30)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=job_env(1, 0),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "displaced: None\n"


def test_a_file_system_without_locks_is_said_once_and_the_manager_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """flock refused (ENOLCK: NFS without its lock daemon; Lustre without flock says ENOSYS)."""

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    warnings = caplog.at_level(logging.WARNING, logger="cluster.storage.checkpoint_lock")
    with warnings, mlp(tmp_path) as ckpt:
        ckpt.save(1, {"step": 1})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert f"cannot lock {tmp_path / 'rank_0' / '.mlp.lock'} (No locks available)" in lines[0]
    assert "goes on without the lock" in lines[0]


def fill_inodes(directory: Path) -> list[Path]:
    """Empty files made in `directory` until its file system has no inode left; their paths."""
    made: list[Path] = []
    for count in range(4096):
        path = directory / f"filler-{count}"
        try:
            path.touch()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return made
        made.append(path)
    raise AssertionError(f"{directory}: 4096 files made, and still room for more")


def test_a_lock_file_that_could_not_be_made_is_made_and_locked_once_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A file system out of inodes (or over its quota) refuses the lock file: the manager goes
    on without it, saying so once (its saves fail there anyway). Once there is room again,
    its next use makes and takes the lock, and a second manager is refused as ever."""
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.0)
    with tmpfs.mounted("1m", inodes=16) as disk:
        (disk / "rank_0").mkdir()
        fillers = fill_inodes(disk)
        with caplog.at_level(logging.WARNING, logger=checkpoint_lock.__name__):
            ckpt = mlp(disk)
            assert ckpt.steps() == []  # used again with no room yet: nothing more said
        said = lines(caplog)
        assert len(said) == 1, said
        assert said[0].startswith(f"cannot lock {disk / 'rank_0' / '.mlp.lock'} (No space left")
        for filler in fillers:
            filler.unlink()
        with caplog.at_level(logging.INFO, logger=checkpoint_lock.__name__):
            ckpt.save(2, {"step": 2})
            ckpt.flush()
        with pytest.raises(CheckpointError, match="in use by another CheckpointManager"):
            mlp(disk)
        assert lines(caplog)[1:] == [
            f"{disk / 'rank_0' / '.mlp.lock'} can be locked now: this manager holds the lock"
        ]
        ckpt.close()


def test_on_a_read_only_file_system_managers_read_without_the_lock_and_say_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Checkpoints kept on a file system mounted read-only: no manager can write there, so
    there is nothing to keep apart; each loads without the lock, and nothing is said."""
    with tmpfs.mounted("1m") as disk:
        with mlp(disk) as ckpt:
            ckpt.save(1, {"step": 1})
            ckpt.flush()
        tmpfs.make_read_only(disk)
        with caplog.at_level(logging.DEBUG, logger=checkpoint_lock.__name__):
            first, second = mlp(disk), mlp(disk)
            assert first.load(1) == {"step": 1}
            assert second.steps() == [1]
            first.close()
            second.close()
        assert lines(caplog) == []


# -- within one job: the scheduler decides who holds a rank ---------------------------------

JOB, OTHER_JOB = "0a1b2c3d4e5f", "ffeeddccbbaa"
EARLIER = checkpoint_lock.Seat(JOB, "1", 11, 1)  # node 1 held rank 1 in generation 1
SPARE = checkpoint_lock.Seat(JOB, "spare-0", 22, 2)  # the spare given rank 1 in generation 2

# Holds `argv[1]/.mlp.lock` with the seat of argv[3:] ('-': outside any job) until it is
# killed, after waiting at most argv[2] s for an earlier holder of the rank in its job; says
# whether it holds the lock or goes on behind such a holder. With argv[3] 'foreign', holds
# the lock on a file that names no holder.
SEATED = """
import fcntl, os, sys, threading
from pathlib import Path
from cluster.storage import checkpoint_lock
from cluster.storage.checkpoint_lock import CheckpointLock, Seat

directory, args = Path(sys.argv[1]), sys.argv[3:]
if args[0] == "foreign":
    fd = os.open(directory / ".mlp.lock", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"a file some other program locks\\n")
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("holding", flush=True)
else:
    checkpoint_lock.SUCCESSOR_WAIT_S = float(sys.argv[2])
    seat = None if args[0] == "-" else Seat(args[0], args[1], int(args[2]), int(args[3]))
    lock = CheckpointLock(directory, "mlp")
    lock.acquire(seat=seat)
    print("holding" if lock.held else "behind", flush=True)
threading.Event().wait(600)
"""


def seated(
    processes: Procs, directory: Path, seat: checkpoint_lock.Seat | str | None, wait: str = "0"
) -> Process:
    """A process holding (or behind) the lock of `directory` with `seat` ('foreign': a file
    that names no holder)."""
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(seat, checkpoint_lock.Seat):
        words = [seat.job, seat.node, str(seat.incarnation), str(seat.generation)]
    else:
        words = [seat or "-"]
    args = [PYTHON, "-c", SEATED, str(directory), wait, *words]
    proc = processes.start("seated", args, job_env(1, 0))
    wait_until(lambda: "holding" in proc.output or "behind" in proc.output, 30, "the lock")
    return proc


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == checkpoint_lock.__name__]


def test_only_a_later_holder_of_the_rank_in_the_same_job_replaces_one() -> None:
    assert checkpoint_lock.replaces(SPARE, EARLIER)
    restarted = checkpoint_lock.Seat(JOB, "1", 33, 2)  # node 1 again, a new incarnation
    assert checkpoint_lock.replaces(restarted, EARLIER)
    assert not checkpoint_lock.replaces(EARLIER, SPARE)  # an older seat never
    assert not checkpoint_lock.replaces(checkpoint_lock.Seat(JOB, "spare-0", 22, 1), EARLIER)
    assert not checkpoint_lock.replaces(checkpoint_lock.Seat(JOB, "1", 11, 2), EARLIER)  # itself
    assert not checkpoint_lock.replaces(checkpoint_lock.Seat(OTHER_JOB, "spare-0", 22, 2), EARLIER)
    assert not checkpoint_lock.replaces(None, EARLIER)  # a manager outside any job
    assert not checkpoint_lock.replaces(SPARE, None)  # a holder outside any job


def test_a_newcomer_goes_on_behind_an_earlier_holder_of_its_job_and_takes_the_lock_later(
    processes: Procs,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stopped worker's lock (alive, silent): the spare given its rank waits
    SUCCESSOR_WAIT_S, not WAIT_S, says so in one line, claims the file, and takes the lock at
    its first try after the earlier holder is gone."""
    earlier = seated(processes, tmp_path, EARLIER)
    earlier.signal(signal.SIGSTOP)  # silent but alive: its lock stays
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 60.0)
    monkeypatch.setattr(checkpoint_lock, "SUCCESSOR_WAIT_S", 0.2)
    lock = checkpoint_lock.CheckpointLock(tmp_path, "mlp")
    with caplog.at_level(logging.INFO, logger=checkpoint_lock.__name__):
        lock.acquire(seat=SPARE)
        assert lock.behind
        assert not lock.held
        said = lines(caplog)
        assert len(said) == 1, said
        assert (
            f"are locked by an earlier holder of this rank in this job (pid {earlier.pid} on "
            f"host {socket.gethostname()}, this host; node '1' of job {JOB}, generation 1), which "
            "the scheduler replaced by this process in generation 2: this CheckpointManager goes "
            "on without the lock, and takes it once that process is gone"
        ) in said[0]
        claim = (tmp_path / ".mlp.lock").read_text()
        assert json.loads(claim) == {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "job": JOB,
            "node": "spare-0",
            "incarnation": 22,
            "generation": 2,
        }
        lock.acquire(seat=SPARE)  # the earlier holder is still there: no wait, nothing said
        assert lock.behind
        assert len(lines(caplog)) == 1
        earlier.signal(signal.SIGKILL)
        earlier.wait(10)
        lock.acquire(seat=SPARE)
    assert lock.held
    assert not lock.behind
    assert lines(caplog)[-1].endswith("is gone: this manager holds the lock now")
    assert (tmp_path / ".mlp.lock").read_text() == claim
    lock.release()


@pytest.mark.parametrize("holder", ["other job", "outside any job", "foreign file", "same seat"])
def test_a_lock_of_another_job_or_of_no_job_is_waited_for_and_refused(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holder: str
) -> None:
    """Only an earlier holder of the rank in the newcomer's job is gone on without; any other
    holder (another job given the same directory, a process outside a job, a file that names
    nobody, a holder of this job that is no earlier) keeps the wait and the refusal."""
    seat: checkpoint_lock.Seat | str | None = {
        "other job": checkpoint_lock.Seat(OTHER_JOB, "1", 11, 1),
        "outside any job": None,
        "foreign file": "foreign",
        "same seat": checkpoint_lock.Seat(JOB, "spare-0", 44, 2),  # the same generation
    }[holder]
    first = seated(processes, tmp_path, seat)
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.3)
    monkeypatch.setattr(checkpoint_lock, "SUCCESSOR_WAIT_S", 0.0)
    lock = checkpoint_lock.CheckpointLock(tmp_path, "mlp")
    with pytest.raises(CheckpointError, match=r"waited 0\.3 s for it to end") as refused:
        lock.acquire(seat=SPARE)
    assert not lock.held
    assert not lock.behind
    if holder == "foreign file":
        assert "(a process whose pid and host are not in the lock file yet, " in str(refused.value)
    else:
        assert f"(pid {first.pid} on host " in str(refused.value)
    if holder == "other job":
        assert f"node '1' of job {OTHER_JOB}, generation 1, which holds" in str(refused.value)


def test_a_manager_outside_any_job_is_refused_by_an_earlier_holder_of_a_job(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No job (no cluster.init()): no seat, today's wait and refusal, whatever the holder."""
    seated(processes, tmp_path / "rank_0", EARLIER)
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.3)
    monkeypatch.setattr(checkpoint_lock, "SUCCESSOR_WAIT_S", 0.0)
    with pytest.raises(CheckpointError, match=f"node '1' of job {JOB}, generation 1, which holds"):
        mlp(tmp_path)


def test_a_displaced_holder_writes_nothing_more_in_the_rank_directory(
    processes: Procs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The earlier holder (this process: its seat learnt after it took the lock, as a manager
    made before cluster.init() is) reads the spare's claim: its writer writes, prunes and
    removes nothing there any more, and says so once."""
    ckpt = mlp(tmp_path)
    ckpt.save(1, {"step": 1})
    ckpt.flush()
    assert ckpt._lock is not None
    ckpt._lock.acquire(seat=EARLIER)  # held: the seat is written in
    assert json.loads((tmp_path / "rank_0" / ".mlp.lock").read_text())["generation"] == 1
    assert ckpt._lock.displaced() is None
    spare = seated(processes, tmp_path / "rank_0", SPARE, wait="0")
    assert "behind" in spare.output
    holder = ckpt._lock.displaced()
    assert holder is not None
    assert holder.pid == spare.pid
    with caplog.at_level(logging.WARNING, logger="cluster.api.checkpoint"):
        for step in (2, 3):
            ckpt.save(step, {"step": step})
        ckpt.flush()
    assert ckpt.steps() == [1]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert said[0].endswith(
        f"went to another process of this job ({holder}), which the scheduler gave the rank to: "
        "this one writes nothing more there, whatever happens to the lock file (its saves are "
        "dropped), and ends once it hears its rank went away; stop it if it trains on"
    )
    ckpt.close()


def test_a_replaced_process_that_comes_late_goes_on_at_once_and_writes_nothing(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stopped before it made its manager, continued after the spare took its rank:
    the file names the spare, which replaces it; it neither waits nor claims, and is displaced
    (its writer writes nothing) until it ends on hearing that its rank went away."""
    spare = seated(processes, tmp_path, SPARE)
    claim = (tmp_path / ".mlp.lock").read_text()
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 60.0)
    monkeypatch.setattr(checkpoint_lock, "SUCCESSOR_WAIT_S", 60.0)
    lock = checkpoint_lock.CheckpointLock(tmp_path, "mlp")
    lock.acquire(seat=EARLIER)  # at once (the test's timeout otherwise)
    assert lock.behind
    assert not lock.held
    holder = lock.displaced()
    assert holder is not None
    assert holder.pid == spare.pid
    assert (tmp_path / ".mlp.lock").read_text() == claim
