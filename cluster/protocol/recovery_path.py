"""Whether a directory is safe to keep a job's recovery state in: the decision, without I/O.

Everything under MS_RECOVERY_PATH is written by the job's processes (root, often) and read back
as the job's state, so nobody else may be able to put a name there: a link planted at a name the
job writes would make it write where the link points, and a file planted at a name it reads
would be loaded as its state. The rule, for a process of uid U:

- the recovery directory belongs to U and neither its group nor others may write it. The sticky
  bit (1777, /tmp's mode) does not make it safe: it keeps others from removing what is there,
  not from creating the names the job has not made yet (its lock, its key-value log, the file
  of a worker that has not started), so such a directory is refused too;
- every directory above it belongs to root or to U, and one that others may write has the
  sticky bit (as /tmp has): otherwise anyone could rename the recovery directory away and put
  one of theirs in its place. A parent that its group may write is accepted: that is how a
  volume is shared by the pods of one job (Kubernetes' fsGroup makes it 2775), and its group is
  the job's; the recovery directory inside it is still the job user's alone;
- every symbolic link on the way belongs to root or to U (so it points where they said).

`problem(...)` takes what stat said of each (`Entry`) and returns the one line that says what is
wrong and how to fix it, or None; `cluster.storage.recovery_dir.check_recovery_path` gathers the
entries and raises it as a ConfigError.
"""

from __future__ import annotations

import stat
from collections.abc import Mapping, Sequence

from cluster.protocol.value import frozen

ROOT_UID = 0
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


@frozen
class Entry:
    """What stat (lstat for a link) said of one path: its owner and its st_mode."""

    path: str
    uid: int
    mode: int


def _who(uid: int, names: Mapping[int, str]) -> str:
    return f"uid {uid} ({names[uid]})" if uid in names else f"uid {uid}"


def _mode(entry: Entry, names: Mapping[int, str]) -> str:
    return f"mode {stat.S_IMODE(entry.mode):04o}, owner {_who(entry.uid, names)}"


def _fix(directory: Entry, uid: int, names: Mapping[int, str]) -> str:
    """How to get a safe recovery path, given that `directory` is not one."""
    shared = directory.mode & stat.S_IWOTH and directory.mode & stat.S_ISVTX
    if shared:  # /tmp and the like: a directory of one's own inside it is safe
        return (
            "make a directory of this user's own inside it and use that: "
            f"`mkdir -m 700 {directory.path.rstrip('/')}/JOB` and MS_RECOVERY_PATH="
            f"{directory.path.rstrip('/')}/JOB"
        )
    if directory.uid == uid:
        return f"`chmod go-w {directory.path}` (or `chmod 700`), or use another directory"
    return (
        f"use a directory that this user ({_who(uid, names)}) owns and only it can write "
        "(`mkdir -m 700 DIR`), or run the job as its owner"
    )


def _above(entry: Entry, uid: int, names: Mapping[int, str]) -> str | None:
    """What is wrong with `entry`, a directory or link on the way to the recovery directory."""
    if entry.uid not in (ROOT_UID, uid):
        what = "the link" if stat.S_ISLNK(entry.mode) else "the directory"
        return (
            f"{what} {entry.path!r} on its way belongs to {_who(entry.uid, names)}, who could "
            "put another directory in its place"
        )
    if stat.S_ISLNK(entry.mode):
        return None
    if entry.mode & stat.S_IWOTH and not entry.mode & stat.S_ISVTX:
        return (
            f"the directory {entry.path!r} above it can be written by others without the "
            f"sticky bit ({_mode(entry, names)}), so anyone could put another directory in "
            "its place"
        )
    return None


def problem(
    directory: Entry, above: Sequence[Entry], uid: int, names: Mapping[int, str] | None = None
) -> str | None:
    """Why a process of `uid` must not keep its state in `directory` (None when it may), in
    one line that names the path, its owner and mode, and the fix. `above`: the directories and
    links on the way to it; `names`: user names to show beside uids."""
    names = names or {}
    where = f"MS_RECOVERY_PATH={directory.path!r}"
    if directory.uid != uid:
        return (
            f"{where} belongs to {_who(directory.uid, names)}, not to this process "
            f"({_who(uid, names)}): its owner could plant links there that this job would write "
            f"through; {_fix(directory, uid, names)}"
        )
    if directory.mode & _WRITABLE_BY_OTHERS:
        return (
            f"{where} can be written by users other than its owner ({_mode(directory, names)}): "
            "a local user could plant "
            "links there that this job would write through, or files it would load as its "
            f"state; {_fix(directory, uid, names)}"
        )
    for entry in above:
        wrong = _above(entry, uid, names)
        if wrong is not None:
            return (
                f"{where} is not safe: {wrong}; use a directory whose every parent only root "
                "or this user can write (or has the sticky bit, as /tmp)"
            )
    return None
