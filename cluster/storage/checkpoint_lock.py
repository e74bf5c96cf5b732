"""One `CheckpointManager` at a time per rank directory and prefix: a lock file
(`holder_lock`).

Two managers of one rank and prefix (two jobs given the same directory and prefix, a second
process started by mistake) would each prune the other's newer checkpoints and remove the
other's temporaries mid-write. So a manager holds `rank_<r>/.<prefix>.lock` with an exclusive
`flock` from the moment it takes its rank until it is closed or dropped, or its process ends:
the kernel releases the lock of a process that ends, however it ends (SIGKILL included), so a
restarted worker takes it at once. The holder writes its pid and host into the file (a line of
JSON, `holder_lock.write_holder`), and in a job its seat (`Seat`: the job's id, its node id and
incarnation, the generation it took the rank in), for the message of the one refused and for
the decision below.

One that finds the lock held waits for it up to `WAIT_S` (a failed predecessor on the same host
may still be exiting, flushing its last write), saying so in one line, then is refused with a
CheckpointError naming the directory, the prefix, the holder and what to do. A second manager
of the same process is refused at once: waiting cannot help.

Within one job the scheduler decides who holds a rank: a holder of an earlier generation of
the same job, another node or incarnation (`replaces`), is a process the scheduler has replaced
(it went silent but lives on: SIGSTOPped, cut off, its host paused; or its host died and shared
storage keeps its lock for the lease). The newcomer waits `SUCCESSOR_WAIT_S` for it to end,
then goes on without the lock, saying so in one line, and writes its own seat into the file (a
claim: the earlier holder, which ends once it hears its rank went to another, writes nothing
more there once it reads it, `displaced`); each later `acquire` tries again, without waiting,
and takes the lock once the earlier holder is gone. The claim outlives the file: an earlier
holder that read it remembers it, and makes no new lock where the file is removed (alone, or
with its directory); a newcomer whose claim went with the file before the earlier holder read
it finds the new file locked by that holder at its next `acquire`, and claims it again. A
lock held by another job, by a process outside any job, or named by an unreadable file (a file
of another program; one written before the holder was a line of JSON) keeps the wait and the
refusal.

A child forked by the holder (a data loader's worker) closes its copy of the descriptor at
once (`holder_lock.close_in_child`), so it never keeps the lock after the holder is gone; `exec`
closes it too (O_CLOEXEC).
Its copy of a holder's `CheckpointLock` holds nothing (`held` is False there): its `acquire`,
before each save, load or listing through that manager, raises a CheckpointError naming the
parent the lock belongs to, and it writes nothing into the lock file.
The file is opened without following a link (`atomic`), and written, or read for a claim, only
when it is this user's own regular file with one name (a FIFO put there never blocks the reader).
It stays when released: removing it would let a newcomer lock a new file while a waiter locks
the old one. Where the lock cannot be taken at all (a file system without `flock`, such as
Lustre mounted without it), the manager goes on without it, saying so once. Where the file
cannot be opened (a directory this process cannot write; a file system out of room, inodes or
quota), it goes on without it too, saying so once, and each later `acquire` tries again: it
holds the lock once the file can be made (on a read-only file system nothing can write the
files, and nothing is said).

The lock is the file its path names. One removed or replaced while held (by hand, with its
directory) keeps no other manager out: a newcomer makes a new one and locks it. So each
`acquire` of the holder (before each save, load or listing) checks that the path still names
its file; where it does not, the holder lets its lock go, says so in one line and locks the
file there now, or, where another manager has locked that one since, is refused at once with a
CheckpointError naming it. A lock taken on a file removed between its open and its `flock` is
never kept: `holder_lock.try_lock` opens the path anew.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from cluster.protocol.errors import CheckpointError
from cluster.protocol.value import frozen
from cluster.storage import atomic, holder_lock

_log = logging.getLogger(__name__)

# How long a manager waits for the lock held by another process before it is refused: longer
# than a failed worker takes to end once it hears its rank went to another (its bounded exit,
# `cluster.worker.ending.GRACE_S`, 5 s), with room for a loaded machine.
WAIT_S = 15.0
# How long a manager waits for an earlier holder of its rank in its job (`replaces`) before it
# goes on without the lock: a predecessor on this host that is exiting is gone by then.
SUCCESSOR_WAIT_S = 2.0
_POLL_S = 0.05
# What `_take` found instead of the lock: no locks on this file system (said); an earlier
# holder of the rank in this job, which this manager goes on without.
_Missed = Literal["unavailable", "behind"]


@frozen
class Seat:
    """Who holds a rank in job terms: the job (the cluster id its scheduler gave at
    registration), the node id and incarnation of the process, and the generation in which it
    held the rank when it took the lock."""

    job: str
    node: str
    incarnation: int
    generation: int


@frozen
class Holder:
    """Who holds a lock, as its file says."""

    pid: int
    host: str
    seat: Seat | None

    def __str__(self) -> str:
        here = ", this host" if self.host == socket.gethostname() else ""
        where = f"pid {self.pid} on host {self.host}{here}"
        if self.seat is None:
            return where
        seat = self.seat
        return f"{where}; node {seat.node!r} of job {seat.job}, generation {seat.generation}"


def replaces(newer: Seat | None, older: Seat | None) -> bool:
    """Whether the process of seat `newer` holds the rank that the process of `older` held
    before it in the same job: another node or incarnation, to which the scheduler gave the rank
    in a later generation. False outside a job (either None) and across jobs."""
    if newer is None or older is None or newer.job != older.job:
        return False
    other = (newer.node, newer.incarnation) != (older.node, older.incarnation)
    return other and newer.generation > older.generation


def _same_process(one: Seat | None, other: Seat | None) -> bool:
    """Whether two seats are one process's (its generation may have moved on)."""
    if one is None or other is None:
        return False
    return (one.job, one.node, one.incarnation) == (other.job, other.node, other.incarnation)


def lock_name(prefix: str) -> str:
    """The name of the lock file of `prefix` in a rank directory."""
    return f".{prefix}.lock"


class CheckpointLock:
    """The lock of the checkpoints of `prefix` in the rank directory `directory`."""

    def __init__(self, directory: Path, prefix: str) -> None:
        self.path = directory / lock_name(prefix)
        self.prefix = prefix
        self._finalizer: weakref.finalize[[int, int], CheckpointLock] | None = None
        self._fd: int | None = None  # the held lock's descriptor
        self._pid = 0  # the process that took it (a child forked since holds nothing)
        self._seat: Seat | None = None  # as the file says it, while held or behind
        self._unavailable = False  # this file system has no locks (said)
        self._unmade = False  # the file could not be opened at the last try (said)
        self.behind = False  # going on without the lock, behind an earlier holder (said)
        # The process of this job that the rank went to, once known (`displaced`): this
        # manager makes no new lock and writes nothing more, whatever happens to the file.
        self._gone_to: Holder | None = None
        # Where this lock's lines go: the worker's own lines in a job (`acquire`'s `say`),
        # else this module's log.
        self._say: Callable[[str], None] | None = None

    @property
    def held(self) -> bool:
        alive = self._finalizer is not None and self._finalizer.alive
        return alive and self._pid == os.getpid()

    def acquire(
        self,
        wait_s: float | None = None,
        seat: Seat | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        """Hold the lock (nothing when held already, but a `seat` learnt since is written in);
        CheckpointError when another manager holds it (after `wait_s`, default WAIT_S, when it
        is another process), when this is a child forked from the process that holds it, or
        when a planted file is in its way. `seat`: this process's in its job,
        when the scheduler gave it this rank; behind a holder it `replaces`, the manager goes on
        without the lock (`behind`) and the next call tries again, without waiting. `say`: where
        its lines go (default: this module's log)."""
        self._say = say or self._say
        if self._unavailable:
            return
        if self._fd is not None and self._pid != os.getpid():
            raise CheckpointError(self._forked())
        if self._gone_to is not None:
            self._stay_out(self._gone_to)
            return
        lost = self._fd is not None and not holder_lock.still_holds(self._fd, self.path)
        if lost:
            self._let_go_of_lost()
        elif self.held:
            if self._seat is None and seat is not None and self._fd is not None:
                self._seat = seat  # connected to its job since it took the lock
                _write_holder(self._fd, seat)
            return
        wait_s = 0.0 if lost else WAIT_S if wait_s is None else wait_s
        fd = self._open()
        if fd is None:
            return
        try:
            taken = self._take(fd, wait_s, seat, lost)
        except BaseException:
            os.close(fd)
            raise
        if taken is not None:
            os.close(fd)
            self._seat, self.behind = (seat, True) if taken == "behind" else (None, False)
            return
        if self.behind:
            line = f"the earlier holder of {self._what()} is gone: this manager holds the lock now"
            self._tell(logging.INFO, line)
        elif self._unmade:
            self._tell(logging.INFO, f"{self.path} can be locked now: this manager holds the lock")
        self._unmade = False
        _write_holder(fd, seat)
        self._fd, self._seat, self.behind, self._pid = fd, seat, False, os.getpid()
        # Released by `release`, or when this object is dropped; the process's end does it too.
        self._finalizer = weakref.finalize(self, _let_go, fd, os.getpid())
        self._finalizer.atexit = False

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._fd, self._seat, self.behind = None, None, False

    def _let_go_of_lost(self) -> None:
        """The lock file this manager holds was removed or replaced (by hand, with its
        directory): its lock keeps no other manager out. Let it go, and say so."""
        self.release()
        self._tell(
            logging.WARNING,
            f"{self.path} was removed or replaced while this CheckpointManager held it, so its "
            "lock kept no other manager out: locking the file there now",
        )

    def _stay_out(self, gone_to: Holder) -> None:
        """Displaced: where the file this manager held was removed or replaced, let go of it
        (said), and make no new one: the successor, which goes on without the lock, would
        never claim it, and both would write the rank's files."""
        if self._fd is None or holder_lock.still_holds(self._fd, self.path):
            return
        self.release()
        self._tell(
            logging.WARNING,
            f"{self.path} was removed or replaced while this CheckpointManager held it, but "
            f"{self._what()} went to another process of this job ({gone_to}): this manager "
            "makes no new lock there",
        )

    def displaced(self) -> Holder | None:
        """The process of this job that holds the rank now, once its claim was in the file (it
        `replaces` this manager's seat): this manager writes nothing more there, and makes no
        new lock file, whatever happens to this one (remembered). None otherwise, also when the
        file cannot be read."""
        holder = None if self._seat is None else _read_holder_at(self.path)
        if holder is not None and replaces(holder.seat, self._seat):
            self._gone_to = holder  # the newest claim read, named in what is said
        return self._gone_to

    def _what(self) -> str:
        return f"the checkpoints of prefix {self.prefix!r} in {self.path.parent}"

    def _open(self) -> int | None:
        """The lock file, open for reading and writing; None when it cannot be (said)."""
        try:
            fd, unfit = atomic.open_own(self.path)
        except OSError as exc:
            self._unopened(exc)
            return None
        if fd is not None:
            return fd
        if unfit == "a symbolic link":
            raise CheckpointError(
                f"{self.path} is a symbolic link: it was not made by a CheckpointManager, "
                f"and is never followed; remove it, and let only the job's user write "
                f"{self.path.parent}"
            )
        raise CheckpointError(
            f"{self.path} is {unfit}: it was not made by a CheckpointManager of this user, "
            f"and writing it would change a file elsewhere; remove it, and let only the "
            f"job's user write {self.path.parent}"
        )

    def _take(self, fd: int, wait_s: float, seat: Seat | None, lost: bool) -> _Missed | None:
        """Lock `fd` (the file that `path` names: `holder_lock.try_lock` opens it anew onto `fd`
        when it was removed or replaced before it was locked), waiting up to `wait_s` for
        another process; None once held (a forked child closes its copy of `fd`). `lost`: this
        manager's own file was removed or replaced while it held it (a refusal says so). Or
        "unavailable" when this file system has no locks (said); or "behind" when an earlier
        holder of this rank in this job holds it (after SUCCESSOR_WAIT_S, at once when behind
        it already; said once), or when the file names this process's own claim or a process
        that replaced it (at once; its writer then writes nothing, `displaced`). A file that
        names no live process is read again for up to `holder_lock.SETTLE_S` at each try (its
        holder may not have written itself yet)."""
        start = time.monotonic()
        said = False
        while True:
            try:
                found = holder_lock.try_lock(fd, self.path)
            except OSError as exc:  # ENOLCK, ENOSYS, EOPNOTSUPP: no locks here
                self._unavailable = True
                self._without(exc)
                return "unavailable"
            info = os.fstat(fd)  # of the file that `path` named when it was locked
            key = (info.st_dev, info.st_ino)
            if found is None:
                holder_lock.close_in_child(fd, key)
                return None
            ours = holder_lock.held_here(key)
            if ours:
                raise CheckpointError(self._refusal(None, ours, wait_s, lost))
            holder = _holder(found)
            theirs = None if holder is None else holder.seat
            if replaces(theirs, seat):
                self._gone_to = holder  # it was replaced (`displaced`): remembered
                return "behind"
            if _same_process(seat, theirs):
                return "behind"  # this process's own claim
            waited = time.monotonic() - start
            if replaces(seat, theirs) and holder is not None:
                if self.behind or waited >= min(SUCCESSOR_WAIT_S, wait_s):
                    self._step_in(fd, holder, seat)
                    return "behind"
            elif waited >= wait_s:
                raise CheckpointError(self._refusal(holder, ours, wait_s, lost))
            elif not said:
                said = True
                self._tell(
                    logging.INFO,
                    f"{self._what()} are in use by another CheckpointManager "
                    f"({_described(holder)}): waiting up to {wait_s:.0f} s for it to end",
                )
            time.sleep(_POLL_S)

    def _step_in(self, fd: int, holder: Holder, seat: Seat | None) -> None:
        """Go on without the lock held by `holder`, which this process's `seat` replaces:
        write the claim the earlier holder reads (`displaced`) and say so. Behind it already,
        the file names the holder, not this claim: the file was removed (alone, or with its
        directory) before the holder read the claim, and it made a new one and locked it;
        claim that one again (said), or both would write the rank's files for good."""
        _write_holder(fd, seat)
        if self.behind:
            self._tell(
                logging.WARNING,
                f"the claim this process wrote in {self.path} is gone (the file was removed and "
                f"made anew), and the earlier holder of this rank in this job ({holder}) locked "
                "the new one: claimed it again, so that it writes nothing more there",
            )
            return
        generation = "" if seat is None else f" in generation {seat.generation}"
        self._tell(
            logging.WARNING,
            f"{self._what()} are locked by an earlier holder of this rank in this job ({holder}), "
            f"which the scheduler replaced by this process{generation}: this CheckpointManager "
            "goes on without the lock, and takes it once that process is gone (it ends once it "
            "hears its rank went to another)",
        )

    def _forked(self) -> str:
        parent = self._pid
        return (
            f"{self._what()} are locked by this CheckpointManager in pid {parent}, the process "
            f"this one (pid {os.getpid()}) was forked from: the lock belongs to pid {parent}, "
            "so a forked child saves, loads and lists nothing through its parent's manager; "
            f"do so in pid {parent}, or make a "
            f"CheckpointManager in this process once pid {parent} has closed its own"
        )

    def _refusal(self, holder: Holder | None, ours: bool, wait_s: float, lost: bool) -> str:
        why = "two managers of one rank and prefix remove each other's checkpoints"
        if ours:
            return (
                f"{self._what()} are in use by another CheckpointManager of this process (pid "
                f"{os.getpid()}): {why}; close() that one first, or go on with it"
            )
        how = f"waited {wait_s:g} s for it to end"
        if lost:
            how = "locked since the file this manager held there was removed or replaced"
        return (
            f"{self._what()} are in use by another CheckpointManager ({_described(holder)}, "
            f"which holds {self.path.name}; {how}): {why}; give each job its own checkpoint "
            "directory or prefix, or stop the other process"
        )

    def _unopened(self, exc: OSError) -> None:
        """The file could not be opened (no room, no inode, no quota left; no permission):
        said once while it lasts, and each use tries again (a full file system has room
        later)."""
        if exc.errno == errno.EROFS or self._unmade:
            return  # read-only: nothing can write the files there, nothing to keep apart
        self._unmade = True
        self._without(exc)

    def _without(self, exc: OSError) -> None:
        self._tell(
            logging.WARNING,
            f"cannot lock {self.path} ({exc.strerror}): this CheckpointManager goes on without "
            f"the lock; make sure no other job uses {self.path.parent} with prefix "
            f"{self.prefix!r}",
        )

    def _tell(self, level: int, line: str) -> None:
        if self._say is not None:
            self._say(line)
        else:
            _log.log(level, "%s", line)


def _holder(found: dict[str, object]) -> Holder | None:
    """The holder that the lock file names (`holder_lock.read_holder`'s answer); None when it
    names none (not written yet, or a file of another program)."""
    match found:
        case {
            "pid": int(pid),
            "host": str(host),
            "job": str(job),
            "node": str(node),
            "incarnation": int(incarnation),
            "generation": int(generation),
        }:
            return Holder(pid, host, Seat(job, node, incarnation, generation))
        case {"pid": int(pid), "host": str(host)}:
            return Holder(pid, host, None)
    return None


def _read_holder_at(path: Path) -> Holder | None:
    """Who the lock file at `path` names; None also when it cannot be opened, or is not this
    user's own regular file: whatever is planted there (a FIFO, which would block the open and
    the read, a large file) is never waited on or read."""
    try:
        fd = atomic.open_no_follow(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if atomic.not_own_file(os.fstat(fd)):
            return None
        return _holder(holder_lock.read_holder(fd))
    except OSError:
        return None
    finally:
        os.close(fd)


def _described(holder: Holder | None) -> str:
    if holder is None:
        return "a process whose pid and host are not in the lock file yet"
    return str(holder)


def _write_holder(fd: int, seat: Seat | None) -> None:
    """Say who holds the lock, or claims it (a failure is harmless: the message of one refused
    says less, and an earlier holder goes on writing until it ends)."""
    fields: dict[str, object] = {}
    if seat is not None:
        fields = {"job": seat.job, "node": seat.node, "incarnation": seat.incarnation}
        fields["generation"] = seat.generation
    holder_lock.write_holder(fd, **fields)


def _let_go(fd: int, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child: its copy was closed at the fork
    holder_lock.let_go(fd)  # the lock goes with the last descriptor of it
