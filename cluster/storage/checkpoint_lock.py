"""One `CheckpointManager` at a time per rank directory and prefix: a lock file.

Two managers of one rank and prefix (two jobs given the same directory and prefix, a second
process started by mistake) would each prune the other's newer checkpoints and remove the
other's temporaries mid-write. So a manager holds `rank_<r>/.<prefix>.lock` with an exclusive
`flock` from the moment it takes its rank until it is closed or dropped, or its process ends:
the kernel releases the lock of a process that ends, however it ends (SIGKILL included), so a
restarted worker takes it at once. The holder writes its pid and host into the file, for the
message of the one refused.

One that finds the lock held waits for it up to `WAIT_S` (a failed predecessor on the same host
may still be exiting, flushing its last write), saying so in one line, then is refused with a
CheckpointError naming the directory, the prefix, the holder and what to do. A second manager
of the same process is refused at once: waiting cannot help. A child forked by the holder (a
data loader's worker) closes its copy of the descriptor at once, so it never keeps the lock
after the holder is gone; `exec` closes it too (O_CLOEXEC).

The file is opened without following a link (`atomic`) and written only when it is this user's
own regular file with one name. It stays when released: removing it would let a newcomer lock a
new file while a waiter locks the old one. Where the lock cannot be taken at all (a file system
without `flock`, such as Lustre mounted without it; a directory this process cannot write), the
manager goes on without it, saying so once (on a read-only file system nothing can write the
files, and nothing is said).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
import threading
import time
import weakref
from pathlib import Path

from cluster.protocol.errors import CheckpointError
from cluster.storage import atomic

_log = logging.getLogger(__name__)

# How long a manager waits for the lock held by another process before it is refused: longer
# than a failed worker takes to end once it hears its rank went to another (its bounded exit,
# `cluster.worker.ending.GRACE_S`, 5 s), with room for a loaded machine.
WAIT_S = 15.0
_POLL_S = 0.05
_HOLDER_RE = re.compile(r"pid=(\d{1,10}) host=([\x21-\x7e]{1,255})\n")

_registry_lock = threading.Lock()
# The lock files this process holds, (device, inode) -> descriptor.
_held: dict[tuple[int, int], int] = {}


def lock_name(prefix: str) -> str:
    """The name of the lock file of `prefix` in a rank directory."""
    return f".{prefix}.lock"


class CheckpointLock:
    """The lock of the checkpoints of `prefix` in the rank directory `directory`."""

    def __init__(self, directory: Path, prefix: str) -> None:
        self.path = directory / lock_name(prefix)
        self.prefix = prefix
        self._finalizer: weakref.finalize[[int, tuple[int, int], int], CheckpointLock] | None = None
        self._unavailable = False  # this file system or directory has no lock for us (said)

    @property
    def held(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def acquire(self, wait_s: float | None = None) -> None:
        """Hold the lock (nothing when held already); CheckpointError when another manager
        holds it (after `wait_s`, default WAIT_S, when it is another process) or a planted file
        is in its way."""
        if self.held or self._unavailable:
            return
        wait_s = WAIT_S if wait_s is None else wait_s
        fd = self._open()
        if fd is None:
            return
        try:
            key = self._take(fd, wait_s)
        except BaseException:
            os.close(fd)
            raise
        if key is None:
            os.close(fd)
            return
        _write_holder(fd)
        # Released by `release`, or when this object is dropped; the process's end does it too.
        self._finalizer = weakref.finalize(self, _let_go, fd, key, os.getpid())
        self._finalizer.atexit = False

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    def _open(self) -> int | None:
        """The lock file, open for reading and writing; None when it cannot be (said)."""
        try:
            fd = atomic.open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointError(
                    f"{self.path} is a symbolic link: it was not made by a CheckpointManager, "
                    f"and is never followed; remove it, and let only the job's user write "
                    f"{self.path.parent}"
                ) from None
            self._without(exc)
            return None
        unfit = atomic.not_own_file(os.fstat(fd))
        if unfit:
            os.close(fd)
            raise CheckpointError(
                f"{self.path} is {unfit}: it was not made by a CheckpointManager of this user, "
                f"and writing it would change a file elsewhere; remove it, and let only the "
                f"job's user write {self.path.parent}"
            )
        return fd

    def _take(self, fd: int, wait_s: float) -> tuple[int, int] | None:
        """Lock `fd`, waiting up to `wait_s` for another process; its (device, inode), or None
        when this file system has no locks (said)."""
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            except OSError as exc:  # ENOLCK, ENOSYS, EOPNOTSUPP: no locks here
                self._without(exc)
                return None
            else:
                with _registry_lock:
                    _held[key] = fd
                return key
            with _registry_lock:
                ours = key in _held
            if ours or time.monotonic() >= deadline:
                raise CheckpointError(self._refusal(fd, ours, wait_s))
            if not said:
                said = True
                _log.info(
                    "the checkpoints of prefix %r in %s are in use by another "
                    "CheckpointManager (%s): waiting up to %.0f s for it to end",
                    self.prefix,
                    self.path.parent,
                    _holder(fd),
                    wait_s,
                )
            time.sleep(_POLL_S)

    def _refusal(self, fd: int, ours: bool, wait_s: float) -> str:
        where = f"the checkpoints of prefix {self.prefix!r} in {self.path.parent}"
        why = "two managers of one rank and prefix remove each other's checkpoints"
        if ours:
            return (
                f"{where} are in use by another CheckpointManager of this process (pid "
                f"{os.getpid()}): {why}; close() that one first, or go on with it"
            )
        return (
            f"{where} are in use by another CheckpointManager ({_holder(fd)}, which holds "
            f"{self.path.name}; waited {wait_s:g} s for it to end): {why}; give each job its "
            "own checkpoint directory or prefix, or stop the other process"
        )

    def _without(self, exc: OSError) -> None:
        self._unavailable = True
        if exc.errno == errno.EROFS:
            return  # nothing can write the files there: nothing to keep apart
        _log.warning(
            "cannot lock %s (%s): this CheckpointManager goes on without the lock; make sure no "
            "other job uses %s with prefix %r",
            self.path,
            exc.strerror,
            self.path.parent,
            self.prefix,
        )


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says."""
    try:
        text = os.pread(fd, 300, 0).decode("ascii", errors="replace")
    except OSError:
        text = ""
    match = _HOLDER_RE.match(text)
    if match is None:
        return "a process whose pid and host are not in the lock file yet"
    pid, host = match.groups()
    here = ", this host" if host == socket.gethostname() else ""
    return f"pid {pid} on host {host}{here}"


def _write_holder(fd: int) -> None:
    """Say who holds the lock (for the message of one refused; a failure is harmless)."""
    data = f"pid={os.getpid()} host={socket.gethostname()}\n".encode()
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    except OSError:
        pass


def _let_go(fd: int, key: tuple[int, int], pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child: its copy was closed at the fork
    with _registry_lock:
        _held.pop(key, None)
    os.close(fd)  # the lock goes with the last descriptor of it


def _close_in_child() -> None:
    """In a child forked by a holder: close the copies of the locks' descriptors, so that the
    child never keeps a lock after the holder is gone."""
    for fd in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)
