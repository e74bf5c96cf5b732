"""Files that grow by appending, kept within a bound: rotated at a size, a few old ones kept.

The scheduler's event log and its log file hold what callers make happen, so an outsider can
make them grow. Each is appended to by the one process that writes it; once the next write
would take it past `LogRotation.max_bytes`, that writer renames FILE to FILE.1 (FILE.1 to
FILE.2, ..., the oldest, FILE.<keep>, dropped) and opens a new FILE. A file is never cut inside
a write, so a line stays whole; a single write larger than the bound still lands, alone in its
file. A write that fails (a full disk) leaves nothing of itself: the part that landed is cut off
again, and where even that fails, the next write starts a line of its own, so the torn line is
one that readers skip and the next is read whole. Files are opened with O_NOFOLLOW: a link
planted where the file goes is not written through. Readers take the old files first
(`in_order`).

The scheduler's log is its stderr: `OutputFileHandler` points descriptors 1 and 2 at the log
file (CLUSTER_LOG_FILE, which `mscluster run` sets to LOG_DIR/scheduler.log) and rotates it
from the logging handler, so what is not logged (a traceback, gRPC's own lines) lands in the
current file too, and the file is checked at every log record. It rotates only once the new
file is open and only the file its stderr writes: while no new file can be opened (no
descriptor left, no inode, a quota), nothing is renamed or removed, and the log grows past its
bound in the current file, which it says once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
from pathlib import Path

from cluster.protocol.config import LogRotation
from cluster.storage.atomic import open_no_follow, remove_temporaries, temporary_name

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND
_READ_WRITE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_APPEND
_MODE = 0o644


def old_file(path: Path, number: int) -> Path:
    """FILE.<number>: the number-th newest full file (1: the newest)."""
    return path.with_name(f"{path.name}.{number}")


def in_order(path: Path) -> list[Path]:
    """The old files of `path` that exist, oldest first, then `path` itself if it exists: the
    order in which their lines were written. Stops at the first number missing."""
    olds = []
    number = 1
    while old_file(path, number).exists():
        olds.append(old_file(path, number))
        number += 1
    return [*reversed(olds), *([path] if path.exists() else [])]


def rotate(path: Path, keep: int) -> None:
    """FILE -> FILE.1 -> ... -> FILE.<keep>; the old files from FILE.<keep> on are removed
    (more than one where `keep` was higher for an earlier writer of the file)."""
    number = keep
    while True:
        try:
            old_file(path, number).unlink()
        except FileNotFoundError:
            break
        number += 1
    for number in range(keep - 1, 0, -1):
        with contextlib.suppress(FileNotFoundError):
            old_file(path, number).rename(old_file(path, number + 1))
    with contextlib.suppress(FileNotFoundError):
        path.rename(old_file(path, 1))


def open_for_append(path: Path, *, readable: bool = False) -> int:
    """A descriptor appending to `path` (made if missing, never through a link; with
    `readable`, one that reads it too); OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return open_no_follow(path, _READ_WRITE_FLAGS if readable else _FLAGS, _MODE)


class RotatingFile:
    """Appends to `path`, rotating it as `rotation` says. Not thread-safe: one writer."""

    def __init__(self, path: Path, rotation: LogRotation) -> None:
        self.path = path
        self.rotation = rotation
        self._fd: int | None = None
        self._size = 0
        self._torn = False  # the file ends inside a line: the next write starts a new one

    def write(self, data: bytes) -> None:
        """Append `data` whole (rotating first when it would not fit); OSError, and then
        nothing of `data` is left in the file (or, when what landed cannot be cut off, the
        next write starts on a line of its own)."""
        if self._fd is None:
            self._open()
        if self._size and self._size + int(self._torn) + len(data) > self.rotation.max_bytes:
            self.close()
            rotate(self.path, self.rotation.keep)
            self._open()
        assert self._fd is not None
        before = self._size
        view = memoryview(b"\n" + data if self._torn else data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
                self._size += written
        except OSError:
            self._cut_back(self._fd, before)
            raise
        self._torn = False

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _open(self) -> None:
        self._fd = open_for_append(self.path, readable=True)
        self._size = os.fstat(self._fd).st_size
        self._torn = self._size > 0 and os.pread(self._fd, 1, self._size - 1) != b"\n"

    def _cut_back(self, fd: int, size: int) -> None:
        """Take the file back to `size` bytes after a failed write; where that fails too, the
        file ends inside a line (the next write starts a new one)."""
        if self._size == size:
            return
        try:
            os.ftruncate(fd, size)
        except OSError:
            self._torn = True
            return
        self._size = size


def needs_rotation(fd: int, rotation: LogRotation) -> bool:
    """Whether the file behind `fd` has reached its bound (False when it is no regular file)."""
    try:
        stat = os.fstat(fd)
    except OSError:
        return False
    return stat.st_size >= rotation.max_bytes and (stat.st_mode & 0o170000) == 0o100000


def redirect_output(path: Path) -> None:
    """Point this process's stdout and stderr (descriptors 1 and 2) at `path`, appended to:
    whatever writes them (logging, a traceback, gRPC's C core) writes the file. OSError."""
    fd = open_for_append(path)
    try:
        _point_output_at(fd)
    finally:
        os.close(fd)


def _point_output_at(fd: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)


def _is_file_at(fd: int, path: Path) -> bool:
    """Whether `fd` is the file at `path` (False when either cannot be looked at)."""
    try:
        held, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


class OutputFileHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Logs to stderr, which it points at `path` (`redirect_output`), and rotates that file
    once a record has taken it to its bound: the process that writes the file rotates it, so
    every writer of its stderr moves to the new file at once. The new file is opened (under a
    temporary name) before anything is renamed; while it cannot be, the current file grows on,
    which is said once (and once more when the log rotates again)."""

    def __init__(self, path: Path, rotation: LogRotation) -> None:
        redirect_output(path)
        super().__init__(sys.stderr)
        self.path = path
        self.rotation = rotation
        self._stuck = False
        remove_temporaries(path)  # a new file of a scheduler killed while it rotated

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if needs_rotation(2, self.rotation):
            self._start_new_file()

    def _start_new_file(self) -> None:
        """Rotate the file stderr writes and point stderr at a new one; when stderr is no
        longer the file at `path` (it was moved away), reopen `path` instead, rotating
        nothing. A failure leaves stderr where it was, and is said once."""
        try:
            if _is_file_at(2, self.path):
                self._rotate_to_new_file()
            else:
                redirect_output(self.path)
        except OSError as exc:
            self._cannot(exc)
            return
        if self._stuck:
            self._stuck = False
            self._say(logging.INFO, "the log file %s rotates again", self.path)

    def _rotate_to_new_file(self) -> None:
        """Open the new file under a temporary name, then rotate and give it its name: nothing
        is renamed unless it could be opened. OSError."""
        new = temporary_name(self.path, secrets.token_hex(8))
        fd = open_no_follow(new, _FLAGS | os.O_EXCL, _MODE)
        try:
            rotate(self.path, self.rotation.keep)
            new.rename(self.path)
            _point_output_at(fd)
        except OSError:
            with contextlib.suppress(OSError):
                new.unlink()
            raise
        finally:
            os.close(fd)

    def _cannot(self, exc: OSError) -> None:
        if not self._stuck:
            self._stuck = True
            self._say(
                logging.ERROR,
                "cannot start a new log file %s (%s): the current one grows past "
                "CLUSTER_LOG_MAX_BYTES (%d) until a new one can be opened",
                self.path,
                exc.strerror or exc,
                self.rotation.max_bytes,
            )

    def _say(self, level: int, message: str, *args: object) -> None:
        name = "cluster.storage.rotation"
        super().emit(logging.LogRecord(name, level, __file__, 0, message, args, None))
