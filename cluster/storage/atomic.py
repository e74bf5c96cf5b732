"""Files a local user cannot redirect, and one way to replace a file so that a crash at any
moment leaves the old file or the new one.

Every file this package writes under a directory (the recovery path, a checkpoint directory, a
log directory) is opened here, with O_NOFOLLOW: a symbolic link planted where the file goes is
refused (ELOOP), never written through (`open_no_follow`). A file that is replaced is written
first to a temporary beside it (same directory, so the rename cannot cross file systems) whose
name holds 64 random bits, `.NAME.<16 hex digits>.tmp`, created with O_EXCL: a name planted in
advance is never opened, and the name to plant cannot be guessed (`create_temporary`).

`write_atomically(path, write, fail)` lets `write(fd)` fill such a temporary, fsyncs it, renames
it over `path` and fsyncs the directory, so the rename itself survives a power cut. Every OSError
on the way becomes the caller's own ClusterError, made by `fail(exc)` in this one place, and the
temporary is removed (as it is when `write` raises anything else); before the rename, the
previous file, if any, is untouched. A failed fsync of the directory comes after the rename: the
new file is in place, not known durable (a caller that tells the two apart gives `unsynced`).
The recovery state files (`store`), the key-value log (`kv_log`) and the checkpoints
(`checkpoint_files`) are all written this way.

A writer that must not write a file that replaced its own (a directory removed or replaced
behind its back) holds its file open and compares it with what the path names
(`names_open_file`): an open file's inode is never reused, so a new file cannot pass for it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from cluster.protocol.errors import ClusterError

NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
# What follows ".NAME." in a temporary's name: random hex digits (and, from releases before
# them, a process id), so that a stale one is recognised and never taken for the file.
TEMPORARY_TAIL = r"\.[0-9a-f]+\.tmp"
_RANDOM_BYTES = 8
_TRIES = 16


def open_no_follow(path: Path, flags: int, mode: int = 0o600) -> int:
    """`os.open(path, flags, mode)` that never follows a link at `path` (OSError ELOOP)."""
    return os.open(path, flags | NO_FOLLOW, mode)


def not_own_file(st: os.stat_result) -> str:
    """What makes the file behind `st` unfit to be written as this process's own (a lock): ''
    when it is this user's regular file with one name, never a file linked in from elsewhere."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this process (uid {os.geteuid()})"
    if st.st_nlink != 1:
        return f"a file with {st.st_nlink} names (a hard link)"
    return ""


def open_own(path: Path) -> tuple[int | None, str]:
    """The file at `path` open for reading and writing (made if missing) as this process's own
    (a lock file): (its descriptor, '') when it is this user's regular file with one name; else
    (None, what it is instead: 'a symbolic link', never followed, or `not_own_file`'s words),
    also where the open fails for what is there (a directory, a socket, a file of another user
    that the kernel's protected_* rules keep closed). OSError for any other failure to open it."""
    try:
        fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, "a symbolic link"
        try:
            there = not_own_file(os.lstat(path))
        except OSError:
            there = ""
        if there:
            return None, there
        raise
    unfit = not_own_file(os.fstat(fd))
    if unfit:
        os.close(fd)
        return None, unfit
    return fd, ""


def open_regular(path: Path) -> int:
    """The file `path`, open for reading: never through a symbolic link (ELOOP), and never
    waiting on what is there (a FIFO is opened without blocking); OSError, also when it is not
    a regular file (its strerror says what it is)."""
    fd = open_no_follow(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{_kind(mode)}, not a regular file", str(path))
    return fd


def _kind(mode: int) -> str:
    kinds = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
    return kinds.get(stat.S_IFMT(mode), "a device")


def read_no_follow(path: Path) -> bytes:
    """The bytes of the regular file at `path`, never read through a link there nor waited on
    (`open_regular`); OSError."""
    with os.fdopen(open_regular(path), "rb") as file:
        return file.read()


def unreadable(what: str, path: Path, exc: OSError, advice: str) -> str:
    """What a refusal of `what` at `path` says when reading it failed with `exc`: a link there
    as one (it is never followed: the system's words, "Too many levels of symbolic links", say
    nothing of that), else the system's cause; then what to do, ending with `advice`."""
    if exc.errno == errno.ELOOP:
        return (
            f"{what} {path} is a symbolic link, which is never followed: put the file itself "
            f"in its place, or {advice}"
        )
    return (
        f"cannot read {what} {path} ({exc.strerror}): make it a file this process can read, "
        f"or {advice}"
    )


def temporary_name(path: Path, tag: str) -> Path:
    return path.with_name(f".{path.name}.{tag}.tmp")


def is_temporary_of(name: str, target: str) -> bool:
    """Whether the file name `name` is a temporary of the file named `target`."""
    return re.fullmatch(re.escape(f".{target}") + TEMPORARY_TAIL, name) is not None


def create_temporary(path: Path) -> tuple[int, Path]:
    """A new, empty temporary beside `path` (mode 0600, read-write) and its name; OSError."""
    for _ in range(_TRIES):
        temporary = temporary_name(path, secrets.token_hex(_RANDOM_BYTES))
        try:
            return open_no_follow(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL), temporary
        except FileExistsError:
            continue  # 64 random bits taken: only by chance, and never for long
    raise FileExistsError(f"no free temporary name beside {path} in {_TRIES} tries")


def remove_temporaries(path: Path) -> None:
    """Remove the temporaries of `path` left by a writer that was killed mid-write (one writer
    per file at a time: the scheduler holds the lock, each worker writes only its own files).
    A link planted under such a name is removed, not followed."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        if is_temporary_of(stale.name, path.name):
            with contextlib.suppress(OSError):
                stale.unlink()


def write_atomically(
    path: Path,
    write: Callable[[int], None],
    fail: Callable[[OSError], ClusterError],
    unsynced: Callable[[OSError], ClusterError] | None = None,
) -> None:
    """Replace `path` with what `write(fd)` writes, atomically and durably; `fail(exc)` is the
    error raised for an OSError before the rename (`exc.strerror` says what the system
    refused): `path` is then as it was. `unsynced(exc)` (default `fail`) is the one raised when
    the directory's fsync fails after the rename: the new file is `path` then, but the rename
    may not survive a crash of the host. `fd` is open for reading too: `write` may check what
    it wrote before the rename makes it `path`."""
    temporary: Path | None = None
    try:
        fd, temporary = create_temporary(path)
        try:
            write(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError as exc:
        _discard(temporary)
        raise fail(exc) from None
    except BaseException:  # the writer gave up (a transfer broke, bytes refused): no torn file
        _discard(temporary)
        raise
    try:
        fsync_directory(path.parent)
    except OSError as exc:
        raise (fail if unsynced is None else unsynced)(exc) from None


def _discard(temporary: Path | None) -> None:
    if temporary is not None:
        with contextlib.suppress(OSError):
            temporary.unlink()


def write_all(fd: int, data: memoryview | bytes) -> None:
    """Write every byte of `data` (os.write may write fewer than it was given)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_directory(directory: Path) -> None:
    """Make a rename (or an unlink) in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def same_file(one: os.stat_result, other: os.stat_result) -> bool:
    """Whether two `stat` results are of one file (the same device and inode)."""
    return (one.st_dev, one.st_ino) == (other.st_dev, other.st_ino)


def names_open_file(path: Path, fd: int) -> bool:
    """Whether `path` itself (never a link there) is the file open at `fd`; False when nothing
    is there. OSError when `path` cannot be looked up. While `fd` stays open its inode is not
    reused, so a file made at `path` later never passes for it."""
    try:
        there = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return same_file(there, os.fstat(fd))
