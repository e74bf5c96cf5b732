"""A real small filesystem for disk-fault tests: a tmpfs mounted by the test, always unmounted.

Needs root (CI runs as root); `mounted` skips the test, saying why, when it cannot mount. `fill`
writes a filler file until the filesystem reports ENOSPC, as a disk filled by another program
would; removing the file gives the space back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

CHUNK = 64 * 1024


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)


@contextlib.contextmanager
def mounted(
    size: str = "1m", *, read_only: bool = False, inodes: int | None = None
) -> Iterator[Path]:
    """A fresh tmpfs of `size` (read-only with `read_only`; with room for `inodes` files and
    directories, its root included, when given), unmounted and removed at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    where = Path(tempfile.mkdtemp(prefix="cluster-tmpfs-"))
    options = f"size={size},mode=0755" + ("" if inodes is None else f",nr_inodes={inodes}")
    mount = _run("mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where))
    if mount.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        if read_only:
            make_read_only(where)
        yield where
    finally:
        if _run("umount", str(where)).returncode != 0:
            _run("umount", "-l", str(where))  # a process of the test still has a file open
        with contextlib.suppress(OSError):
            where.rmdir()


def make_read_only(where: Path) -> None:
    """Mount the tmpfs at `where` read-only from now on (files written before stay)."""
    remount = _run("mount", "-o", "remount,ro", str(where))
    assert remount.returncode == 0, remount.stderr


def fill(directory: Path) -> Path:
    """Write `directory/filler` until the filesystem is full (ENOSPC); the filler's path."""
    filler = directory / "filler"
    block = b"\0" * CHUNK
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            try:
                written = os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(block) == 1:
                    return filler
                block = block[: len(block) // 2]  # the last few bytes too
                continue
            if written < len(block):
                block = block[: max(len(block) // 2, 1)]
    finally:
        os.close(fd)
