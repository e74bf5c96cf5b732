"""A lock file held with an exclusive `flock` for as long as a process uses what it guards, its
holder written into it: one line of JSON (pid, host, and what the holder adds), which the one
refused reads back to name it.

The kernel drops the lock of a process that ends, however it ends (SIGKILL included), so a
holder that died never keeps the next one out. The file is opened without following a link
(`atomic`), with O_CLOEXEC (no child keeps the lock after an exec), and locked only when it is
this user's own regular file with one name. It stays when released: removing it would let a
newcomer lock a new file while another locks the old one.

The lock is the file that the path names: a lock taken on a file that was removed or replaced
between its open and its `flock` keeps no one out, so `try_lock` given the path checks, once it
holds the lock, that the path still names the file it locked, and opens the path anew when not.
A file removed while held (by hand, with its directory) leaves its holder holding a lock no
newcomer sees: `still_holds` tells a holder so, and one that runs long asks it at its natural
points (`checkpoint_lock` before each save, load or listing; `node_file` before the worker
writes its record; `event_file` before each batch of lines, and every second while idle;
`launch_lock` and `relay` every second), then locks the file there now (`take`) or holds
nothing more. `Hold` is that check for `launch_lock`, `relay`, `node_file` and `event_file`:
one state machine, each holder saying what it found (`Relock`) in its own words. Between a
removal and the check a newcomer can lock a new file: `launch_lock` also holds its directory
itself (`lock_directory`), which no removal of a file in it undoes, and takes it first.

A holder that removes its lock file (`launch_lock`'s run refused in a directory it made)
removes it while it holds the lock, and then lets go: a process that opened the file and locks
it once let go finds that the path no longer names it, and locks the file there now. Removed
after the lock was let go, the file could be one that another process had just locked.

`mscluster run`'s log directory (`cluster.tools.launch_lock`), a relay's socket
(`cluster.tools.relay`), the scheduler's event log (`cluster.scheduler.event_file`), a worker's
node record (`cluster.worker.node_file`) and a CheckpointManager's checkpoints of a rank and
prefix (`checkpoint_lock`) are guarded this way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cluster.storage import atomic

# The most of the lock file read for its holder (a line of JSON).
_HOLDER_BYTES = 4096
# How long a refused process reads the lock file again for a holder that has just taken the
# lock and not yet written itself (a few milliseconds; a loaded machine may take longer).
SETTLE_S = 1.0
_SETTLE_POLL_S = 0.01
# How often `try_lock` opens the path anew when the file it locked is no longer there: each
# time needs another removal in the moments between an open and its lock.
_REOPENS = 16


def lock_path(path: Path) -> Path:
    """The lock file that guards `path`: `path` with `.lock` added, beside it."""
    return path.with_name(f"{path.name}.lock")


def open_lock(path: Path) -> int:
    """A descriptor of the lock file `path` (made if missing); OSError, also when it is not
    this user's own regular file with one name (its strerror says what it is)."""
    fd, unfit = atomic.open_own(path)
    if fd is None:
        raise OSError(errno.EPERM, f"it is {unfit}, not a lock file of this user's", str(path))
    return fd


def try_lock(fd: int, path: Path | None = None) -> dict[str, object] | None:
    """Take the lock of `fd` at once: None when this process holds it now, or what its holder
    wrote ({} when nothing readable is there). A holder that has just taken the lock may not
    have written itself yet (the file then names no one, or the holder before it, gone): what
    the file says is read again for up to SETTLE_S, until it names a live process. With `path`,
    the file `fd` is open at: held only while `path` still names it; where the file was removed
    or replaced before it was locked, `fd` is made a descriptor of the file at `path` now (as
    `open_lock` opens it) and that one is locked. OSError when the file system has no locks
    (ENOLCK: NFS without its lock daemon; Lustre mounted without flock), or when `path` cannot
    be opened anew."""
    deadline = time.monotonic() + SETTLE_S
    reopens = 0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(fd)
            if _names_live_process(holder) or time.monotonic() >= deadline:
                return holder
            time.sleep(_SETTLE_POLL_S)  # sleep-ok: the holder writes itself within moments
            continue
        if path is None or still_holds(fd, path):
            return None
        if reopens == _REOPENS:
            raise OSError(errno.EAGAIN, f"removed each of {_REOPENS} times it was locked", path)
        reopens += 1
        _reopen(fd, path)


def take(fd: int, path: Path, **fields: object) -> dict[str, object] | None:
    """`try_lock(fd, path)`: None when this process holds the lock now, and is written into the
    file (`write_holder(fd, **fields)`); otherwise what its holder wrote, and `fd` is closed
    (closed on an OSError too)."""
    try:
        holder = try_lock(fd, path)
    except BaseException:
        os.close(fd)
        raise
    if holder is not None:
        os.close(fd)
        return holder
    write_holder(fd, **fields)
    return None


def still_holds(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open at `fd` (a lock file this process holds):
    False when it was removed (its directory too) or replaced, and the lock of `fd` keeps no
    one out. True when that cannot be told (`path` cannot be looked up)."""
    try:
        return atomic.names_open_file(path, fd)
    except OSError:
        return True


def _reopen(fd: int, path: Path) -> None:
    """Make `fd` a descriptor of the lock file at `path` now (its lock on the file it named
    goes with it); OSError as `open_lock`."""
    fresh = open_lock(path)
    try:
        os.dup2(fresh, fd, inheritable=False)
    finally:
        os.close(fresh)


def held(path: Path) -> bool | None:
    """Whether a process holds the lock file `path` now (False: none does, or there is no file
    there); None when that cannot be told (the file cannot be opened, or its file system has no
    locks). A reader's test: a shared lock taken and let go at once, never waited for, nothing
    written; one that takes the lock meanwhile is refused for moments (`try_lock` tries again
    for up to SETTLE_S)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # the shared lock goes with it
    return False


def lock_directory(directory: Path) -> int | None:
    """A descriptor of `directory` (the one its path leads to, links followed), O_CLOEXEC, on
    which this process holds an exclusive `flock` now; None when another process holds it. A
    guard beside a lock file in it: the directory cannot be removed or replaced behind its
    holder's back as a file can while its holder runs on (`launch_lock`). One removed or
    replaced between its open and its lock is opened anew. OSError when it cannot be opened or
    locked (a file system that locks no directory)."""
    for _ in range(_REOPENS):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if _names_directory(directory, fd):
            return fd
        os.close(fd)
    raise OSError(errno.EAGAIN, f"replaced each of {_REOPENS} times it was locked", directory)


def _names_directory(directory: Path, fd: int) -> bool:
    try:
        return atomic.same_file(os.stat(directory), os.fstat(fd))
    except OSError:
        return False


def live_holder(path: Path, wait_s: float) -> dict[str, object]:
    """What the lock file `path` says of its holder once it names a live process, read again
    for up to `wait_s` (a holder locks its file anew, and writes itself, within moments of
    finding it removed); {} when nothing there names one by then. The file is opened for
    reading only: never made, never through a link."""
    deadline = time.monotonic() + wait_s
    while True:
        holder: dict[str, object] = {}
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                holder = read_holder(fd)
            finally:
                os.close(fd)
        if _names_live_process(holder):
            return holder
        if time.monotonic() >= deadline:
            return {}
        time.sleep(_SETTLE_POLL_S)  # sleep-ok: the holder writes itself within moments


def write_holder(fd: int, **fields: object) -> None:
    """Write this process (pid, host and `fields`) into the lock file open at `fd`, as a rule
    one it holds (`checkpoint_lock` also writes a claim its holder reads): best effort, the
    lock holds without it (the one refused then names no holder). Written over what is there,
    then cut to its length: a reader never finds the file empty meanwhile."""
    holder = {"pid": os.getpid(), "host": socket.gethostname(), **fields}
    line = json.dumps(holder).encode() + b"\n"
    with contextlib.suppress(OSError):
        os.pwrite(fd, line, 0)
        os.ftruncate(fd, len(line))


def _names_live_process(holder: dict[str, object]) -> bool:
    """Whether `holder` names a process that runs (one of another host: taken as running)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it runs, as another user
        return True
    return True


def read_holder(fd: int) -> dict[str, object]:
    """What the holder wrote into the lock file ({} when nothing readable is there yet)."""
    try:
        read = json.loads(os.pread(fd, _HOLDER_BYTES, 0))
    except (OSError, ValueError):
        return {}
    return read if isinstance(read, dict) else {}


def elsewhere(holder: dict[str, object]) -> bool:
    """The holder wrote that it runs on another host (the file is on a shared file system)."""
    host = holder.get("host")
    return host is not None and host != socket.gethostname()


def described(holder: dict[str, object]) -> str:
    """The holder, as a refusal names it: `pid 42 on this host` (or `on host h2`)."""
    pid, host = holder.get("pid"), holder.get("host")
    if pid is None:
        return "a process whose pid is not written yet"
    where = f"host {host}" if elsewhere(holder) else "this host"
    return f"pid {pid} on {where}"


@dataclass(frozen=True)
class Relock:
    """What `Hold.keep` found where the lock file it held was removed or replaced, and what
    locking the file at the path now gave: this process holds it (`taken`), another does
    (`holder`, what it wrote), or it cannot be locked (`error`). `repeated`: an earlier `keep`
    since that loss found it another's or unlockable too (a holder that says a failure once
    says nothing now; one that holds it again says so)."""

    holder: dict[str, object] | None = None
    error: OSError | None = None
    repeated: bool = False

    @property
    def taken(self) -> bool:
        return self.holder is None and self.error is None

    @property
    def cause(self) -> str:
        """Why it cannot be locked (`error`'s words); '' when it could."""
        return "" if self.error is None else str(self.error.strerror or self.error)

    @property
    def news(self) -> bool:
        """Whether a holder that says each failure once per loss has this to say."""
        return self.taken or not self.repeated


class Hold:
    """This process's hold on the lock file `path`, its holder written as `fields`: `lock` a
    descriptor open at the path, `keep` at the holder's natural points, `release` at its end.

    `keep` is nothing while the path names the file held (or nothing is held). Where it does
    not, that file's lock is let go (it keeps no one out) and the file at the path now locked at
    once (`open_file` opens it: `open_lock`), the `Relock` saying how: the holder says it in its
    own words and decides what follows. One that another holds is tried again at each later
    `keep`; one that cannot be locked too with `retry`, without it the holder goes on without
    the lock (`keep` has nothing more to say). With `fork_safe`, a child this process forks
    closes its copy of the descriptor at once (`close_in_child`)."""

    def __init__(
        self,
        path: Path,
        *,
        retry: bool = True,
        fork_safe: bool = False,
        open_file: Callable[[Path], int] = open_lock,
        **fields: object,
    ) -> None:
        self.path = path
        self.fields: dict[str, object] = dict(fields)
        self.fd: int | None = None
        self._retry = retry
        self._fork_safe = fork_safe
        self._open_file = open_file
        self._lost = False  # it held the lock, and its file was removed or replaced since
        self._failed = False  # a `keep` since then found the file there another's or unlockable

    def lock(self, fd: int) -> dict[str, object] | None:
        """`take(fd, path, **fields)`: None when held now; or what its holder wrote (`fd`
        closed). OSError as `take`."""
        holder = take(fd, self.path, **self.fields)
        if holder is None:
            self.fd = fd
            if self._fork_safe:
                close_in_child(fd)
        return holder

    def open_and_lock(self) -> dict[str, object] | None:
        """`lock` the file at the path, opened (made if missing) as `open_file` opens it."""
        return self.lock(self._open_file(self.path))

    def tell(self, **fields: object) -> None:
        """`fields` written from now on, and now where held (`write_holder`: best effort)."""
        self.fields.update(fields)
        if self.fd is not None:
            write_holder(self.fd, **self.fields)

    def keep(self) -> Relock | None:
        """None while the path names the file held (or none is held, and none was lost);
        otherwise the file there now locked at once, and how that went."""
        if self.fd is not None:
            if still_holds(self.fd, self.path):
                return None
            self._close()  # its lock keeps no one out
            self._lost, self._failed = True, False
        elif not self._lost:
            return None
        repeated = self._failed
        try:
            holder = self.open_and_lock()
        except OSError as exc:
            self._lost, self._failed = self._retry, True
            return Relock(error=exc, repeated=repeated)
        self._lost = self._failed = holder is not None
        return Relock(holder=holder, repeated=repeated)

    def release(self) -> None:
        """Let the lock go (the file stays); nothing is lost from here on."""
        self._close()
        self._lost = False

    def _close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            let_go(fd)


_registry_lock = threading.Lock()
# The descriptors of this process's locks that a child it forks closes (`close_in_child`), each
# with the (device, inode) of the file it locks where its holder gave it.
_closed_in_child: dict[int, tuple[int, int] | None] = {}


def close_in_child(fd: int, file: tuple[int, int] | None = None) -> None:
    """Have a child this process forks close its copy of `fd`, the descriptor of a lock this
    process holds, at once (`exec` closes it too: O_CLOEXEC): a `flock` is the open file's,
    which a fork shares, and the lock then goes with this process alone. `file`: the (device,
    inode) it locks, which `held_here` answers for. Until `let_go(fd)`."""
    with _registry_lock:
        _closed_in_child[fd] = file


def let_go(fd: int) -> None:
    """Close `fd`, the descriptor of a lock this process holds (the lock goes with it), and
    forget it (`close_in_child`)."""
    with _registry_lock:
        _closed_in_child.pop(fd, None)
    os.close(fd)


def held_here(file: tuple[int, int]) -> bool:
    """Whether this process holds the lock of `file` (device, inode) through a descriptor a
    child closes (`close_in_child` given `file`)."""
    with _registry_lock:
        return file in _closed_in_child.values()


def _close_in_child() -> None:
    """In a child forked by a holder: close its copies of the descriptors `close_in_child`
    named (the lock stays with the parent's), so that no child keeps a lock after its holder
    is gone; the child holds none. The registry's lock is made anew: a thread of the parent
    that held it at the fork does not run in the child to release it."""
    global _registry_lock
    _registry_lock = threading.Lock()
    for fd in _closed_in_child:
        with contextlib.suppress(OSError):
            os.close(fd)
    _closed_in_child.clear()


os.register_at_fork(after_in_child=_close_in_child)
