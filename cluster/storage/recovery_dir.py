"""The recovery directory on disk: created, checked for who could redirect what the job writes
there, and proved writable. The rules are pure (`cluster.protocol.recovery_path`); this module
gathers what `stat` says and probes the directory."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from cluster.protocol import recovery_path
from cluster.protocol.config import RecoveryConfig
from cluster.protocol.errors import ConfigError


def check_recovery_path(recovery: RecoveryConfig) -> None:
    """Create the recovery directory if needed (mode 0700), refuse it when another user could
    redirect what the job writes there (`recovery_path.problem`), and prove it is writable;
    ConfigError otherwise."""
    path = recovery.path
    try:
        _make(path)
        directory, above = _path_entries(path)
        uids = {os.geteuid(), directory.uid, *(entry.uid for entry in above)}
        unsafe = recovery_path.problem(directory, above, os.geteuid(), _user_names(uids))
        if unsafe is None:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
                pass
    except OSError as exc:
        raise ConfigError(
            f"MS_RECOVERY_PATH={str(path)!r} is not a writable directory ({exc.strerror}): {_FIX}"
        ) from None
    if unsafe is not None:
        raise ConfigError(unsafe)


_FIX = "point it at a directory this process can create files in"


def _make(path: Path) -> None:
    """Create the recovery directory (mode 0700, and the directories above it) unless it is
    there; ConfigError naming what is in the way when that is no directory (mkdir's own words,
    "File exists" or "Not a directory", say nothing of it), OSError otherwise."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"MS_RECOVERY_PATH={str(path)!r} {_in_the_way(path)}") from None


def _in_the_way(path: Path) -> str:
    """What stands where the recovery directory, or one above it, should be, and what to do."""
    ways = (p for p in (path, *path.parents) if os.path.lexists(p) and not p.is_dir())
    blocker = next(ways, path)
    where = "is" if blocker == path else f"lies under {str(blocker)!r}, which is"
    if not blocker.is_symlink():
        return f"{where} a file, not a directory: move that file away, or {_FIX}"
    target = os.readlink(blocker)
    if os.path.exists(blocker):
        return f"{where} a symbolic link to {target!r}, a file, not a directory: {_FIX}"
    return (
        f"{where} a symbolic link to {target!r}, which does not exist (a volume not mounted?): "
        f"make that directory, or {_FIX}"
    )


def _path_entries(path: Path) -> tuple[recovery_path.Entry, list[recovery_path.Entry]]:
    """The recovery directory (links followed) and what lies on the way to it: each link of
    the path as given, each directory above it as given, and each directory above where it
    really is."""

    def entry(at: Path, st: os.stat_result) -> recovery_path.Entry:
        return recovery_path.Entry(str(at), st.st_uid, st.st_mode)

    given = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path))
    above = [entry(p, os.lstat(p)) for p in given.parents]
    if given.is_symlink():
        above.append(entry(given, os.lstat(given)))
    above += [entry(p, os.stat(p)) for p in real.parents if p not in given.parents]
    return entry(given, os.stat(real)), above


def _user_names(uids: set[int]) -> dict[int, str]:
    """The names of the users `uids`, where this machine knows them, to show beside them."""
    try:
        import pwd  # noqa: PLC0415 - POSIX only, and only to say who owns a path
    except ImportError:
        return {}
    names = {}
    for uid in uids:
        with contextlib.suppress(KeyError):
            names[uid] = pwd.getpwuid(uid).pw_name
    return names
