"""One way to replace a file so that a crash at any moment leaves the old file or the new one.

`write_atomically(path, write, fail)` writes a temporary file beside `path` (same directory, so
the rename cannot cross file systems), lets `write(fd)` fill it, fsyncs it, renames it over
`path` and fsyncs the directory, so the rename itself survives a power cut. Every OSError on the
way becomes the caller's own ClusterError, made by `fail(exc)` in this one place, and the
temporary is removed (as it is when `write` raises anything else); the previous file, if any,
is untouched. The recovery state files
(`store`) and the checkpoints (`checkpoint_files`) are both written this way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from cluster.protocol.errors import ClusterError


def temporary_path(path: Path) -> Path:
    """Where `path` is written before its rename: hidden, and named after this process, so a
    temporary left by a killed writer is recognised (and never taken for the file)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_atomically(
    path: Path, write: Callable[[int], None], fail: Callable[[OSError], ClusterError]
) -> None:
    """Replace `path` with what `write(fd)` writes, atomically and durably; `fail(exc)` is the
    error raised for an OSError (`exc.strerror` says what the system refused)."""
    temporary = temporary_path(path)
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            write(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
        fsync_directory(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise fail(exc) from None
    except BaseException:  # the writer gave up (a transfer broke, bytes refused): no torn file
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def write_all(fd: int, data: memoryview | bytes) -> None:
    """Write every byte of `data` (os.write may write fewer than it was given)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_directory(directory: Path) -> None:
    """Make a rename (or an unlink) in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
