"""Recovery state on disk: atomic, versioned, checksummed files under MS_RECOVERY_PATH.

A save writes a temporary file, fsyncs it, renames it over the old one and fsyncs the directory,
so a crash at any moment leaves either the old state or the new one, never a mix. Every file is
an envelope `{"format", "version", "kind", "sha256", "payload"}`: a torn, truncated, edited,
foreign or newer file is reported in one clear StateFileError and never half-loaded; nothing here
overwrites a file it could not read. `RecoveryLock` keeps a second scheduler off the same path,
and says when it no longer can (`check`): the path no longer names the file it locked, as when
the directory was removed or replaced under the scheduler.
Files are read and the lock opened without following a link (`atomic`); the lock is written only
when it is this user's own regular file with one name, never a file linked in from elsewhere.
`left_behind` names what jobs left in a directory that their processes read again (the key-value
log, the records of workers not finished), for a new job's scheduler to say what it starts beside.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cluster.protocol.errors import ConfigError, FencedError, StateFileError
from cluster.storage import atomic, kv_log

FORMAT = "cluster-state"
VERSION = 1
LOCK_NAME = "scheduler.lock"


def _canonical(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def checksum(payload: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(payload)).hexdigest()


def encode(kind: str, payload: dict[str, Any]) -> bytes:
    """The envelope of `payload` as it is stored (in a file, or as an etcd value)."""
    envelope = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "sha256": checksum(payload),
        "payload": payload,
    }
    return json.dumps(envelope, sort_keys=True, indent=1).encode() + b"\n"


def save(path: Path, kind: str, payload: dict[str, Any]) -> None:
    """Replace `path` with `payload` atomically and durably."""
    data = encode(kind, payload)

    def failed(exc: OSError) -> StateFileError:
        return StateFileError(
            f"cannot save the recovery state to {path} ({exc.strerror}); the previous state, if "
            "any, is unchanged"
        )

    def unsynced(exc: OSError) -> StateFileError:
        return StateFileError(
            f"cannot save the recovery state to {path}: the new state is in place, but syncing "
            f"its directory failed ({exc.strerror}), so a crash of the host may still lose it; "
            "it counts as not saved until a save succeeds"
        )

    atomic.write_atomically(path, lambda fd: atomic.write_all(fd, data), failed, unsynced)
    atomic.remove_temporaries(path)


# What to do with a damaged file, by its kind. The scheduler's state names the job that its
# workers' records (worker-<id>.json, beside it on its host, in their own directories elsewhere)
# name too: a new job's scheduler refuses every worker that reads one, so a new job starts on
# directories of its own. A worker's record only tells its process which job it rejoins: without
# it the node registers by its node id alone, and rejoins the job its scheduler runs.
FILE_ADVICE = (
    "restore it from a backup, or move the whole MS_RECOVERY_PATH directory away to start a new "
    "job (on every host of the job: the workers' records there, worker-<id>.json, name this job, "
    "and a new job's scheduler refuses the workers that read them)"
)
# What a saved state that is whole but cannot be resumed (of another worker count or job secret)
# calls for, after the setting that resumes it: a new job, on directories of its own, for the
# same reason.
NEW_JOB_ADVICE = (
    "to start a new job, move the whole MS_RECOVERY_PATH directory away, or give the new "
    "job one of its own (mscluster run --recovery-path), on every host of the job: the workers' "
    "records there, worker-<id>.json, name the saved job, and a new job's scheduler refuses the "
    "workers that read them"
)
NODE_FILE_ADVICE = (
    "move it away: without it this node registers by its node id alone, and rejoins the job its "
    "scheduler runs"
)
NODE_KIND = "worker"
NODE_FILES = "worker-*.json"


def advice_for(kind: str) -> str:
    """What a damaged file of `kind` calls for (FILE_ADVICE, or NODE_FILE_ADVICE)."""
    return NODE_FILE_ADVICE if kind == NODE_KIND else FILE_ADVICE


def load(path: Path, kind: str) -> dict[str, Any] | None:
    """The payload saved at `path`, None when there is no file; StateFileError when unusable."""
    try:
        data = atomic.read_no_follow(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        what = atomic.unreadable("the recovery state", path, exc, advice_for(kind))
        raise StateFileError(what) from None
    return decode(data, kind, str(path), advice_for(kind))


def left_behind(directory: Path) -> tuple[str, ...]:
    """What jobs left in the recovery directory `directory` that their processes read again:
    its key-value log, and the records of the workers that have not finished, a phrase per job
    and kind naming the files ("kv.log (job f139...)", "worker-0.json and worker-1.json (job
    f139...)"). A file that cannot be read is left out: its reader reports it."""
    kv_job = _kv_job(directory)
    left = [f"{kv_log.FILE_NAME} (job {kv_job})"] if kv_job else []
    records: dict[str, list[str]] = {}
    for path in sorted(directory.glob(NODE_FILES)):
        try:
            payload = load(path, NODE_KIND)
        except StateFileError:
            continue
        if payload is not None and not payload.get("finished", True):
            records.setdefault(str(payload.get("cluster_id", "")), []).append(path.name)
    for job, names in records.items():
        shown = names if len(names) <= 3 else [*names[:2], f"{len(names) - 2} more"]
        files = ", ".join(shown[:-1]) + f" and {shown[-1]}" if len(shown) > 1 else shown[0]
        left.append(f"{files} (job {job})")
    return tuple(left)


def _kv_job(directory: Path) -> str:
    """The job that the key-value log in `directory` names ("" when none can be read)."""
    try:
        fd = atomic.open_regular(directory / kv_log.FILE_NAME)
    except OSError:
        return ""
    try:
        head = os.read(fd, 256)
    except OSError:
        return ""
    finally:
        os.close(fd)
    parts = head.partition(b"\n")[0].split(b" ", 2)
    if len(parts) != 3 or parts[0] != kv_log.FORMAT:
        return ""
    return parts[2].decode(errors="replace")


def decode(data: bytes, kind: str, where: str, advice: str) -> dict[str, Any]:
    """The payload of an envelope read from `where`; StateFileError, naming `where` and ending
    with `advice`, when it is torn, foreign, of a newer format or of another kind."""
    try:
        envelope = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        at = f" at byte {exc.pos}" if isinstance(exc, json.JSONDecodeError) else ""
        raise StateFileError(
            f"the recovery state {where} is truncated or corrupt (not valid JSON{at}, "
            f"{len(data)} bytes): {advice}"
        ) from None
    if not isinstance(envelope, dict) or envelope.get("format") != FORMAT:
        raise StateFileError(f"{where} is not a cluster recovery state: {advice}")
    version = envelope.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise StateFileError(
            f"the recovery state {where} has format version {version!r}, but this cluster reads "
            f"version {VERSION} at most (a newer cluster release wrote it, and reads it); {advice}"
        )
    if envelope.get("kind") != kind:
        raise StateFileError(
            f"{where} holds the recovery state of a {envelope.get('kind')!r}, not of a {kind!r}: "
            "two roles share one file name; give each its own MS_RECOVERY_PATH or file"
        )
    payload = envelope.get("payload")
    if not isinstance(payload, dict) or envelope.get("sha256") != checksum(payload):
        raise StateFileError(
            f"the recovery state {where} fails its checksum: it was torn or edited; {advice}"
        )
    return payload


class RecoveryLock:
    """An exclusive lock on a recovery directory, held while a scheduler runs on it."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Lock the directory; ConfigError naming the holder, or what keeps it from being
        locked. The file locked is the one the path names: a lock file removed or replaced
        between its open and its lock (its directory replaced) is opened and locked again."""
        for _ in range(2):
            fd = self._locked_file()
            try:
                if atomic.names_open_file(self.path, fd):
                    break
            except OSError as exc:
                os.close(fd)
                raise self._unusable(exc) from None
            os.close(fd)
        else:
            raise ConfigError(
                f"{self.path} was replaced twice while this scheduler locked it: something "
                f"removes or replaces MS_RECOVERY_PATH={str(self.path.parent)!r}; stop it, "
                "then start the scheduler again"
            )
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:
            os.close(fd)  # the lock goes with it
            raise self._unusable(exc) from None
        self._fd = fd

    def _locked_file(self) -> int:
        """The lock file, opened and locked; ConfigError when it cannot be."""
        try:
            fd = atomic.open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise self._unusable(exc) from None
        planted = atomic.not_own_file(os.fstat(fd))
        if planted:
            os.close(fd)
            raise ConfigError(
                f"{self.path} is {planted}: it was not made by this job, and writing it would "
                "change a file elsewhere; remove it, and let only the job's user write "
                f"MS_RECOVERY_PATH={str(self.path.parent)!r}"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"another scheduler (pid {holder}) is running on MS_RECOVERY_PATH="
                f"{str(self.path.parent)!r}: two schedulers cannot share a recovery path; stop "
                "it, or give this job its own path"
            ) from None
        except OSError as exc:  # ENOLCK (NFSv3 without lockd), EOPNOTSUPP: no lock at all
            os.close(fd)
            raise ConfigError(
                f"MS_RECOVERY_PATH={str(self.path.parent)!r} cannot be locked: its file system "
                f"refuses a lock on {self.path.name} ({exc.strerror}), and without one two "
                "schedulers could share it; point MS_RECOVERY_PATH at a local directory, or "
                "keep the job's state in etcd (CLUSTER_STATE_URL; see docs/howto/standbys.md)"
            ) from None
        return fd

    def check(self) -> None:
        """FencedError unless the lock's path still names the file this process holds locked:
        once MS_RECOVERY_PATH is removed or replaced, another scheduler may lock the new one.
        StateFileError when the path cannot be looked up (a disk fault: tried again)."""
        if self._fd is None:
            raise FencedError(f"this scheduler does not hold the lock of {self.path.parent}")
        try:
            ours = atomic.names_open_file(self.path, self._fd)
        except OSError as exc:
            raise StateFileError(f"cannot look up the lock {self.path} ({exc.strerror})") from None
        if not ours:
            raise FencedError(
                f"the recovery directory MS_RECOVERY_PATH={str(self.path.parent)!r} was removed "
                f"or replaced while this scheduler ran on it ({self.path.name} there is not the "
                "lock it holds), and another scheduler may run on it now; keep a job's recovery "
                "directory in place while its scheduler runs"
            )

    def _unusable(self, exc: OSError) -> ConfigError:
        """Why the lock file could not be opened or written (`exc`), and what to do: what is
        in its place (a link, a directory, a file this process may not open), else the disk."""
        where = f"MS_RECOVERY_PATH={str(self.path.parent)!r}"
        if exc.errno == errno.ELOOP:
            return ConfigError(
                f"{self.path} is a symbolic link: it was not made by this job, and is never "
                f"followed; remove it, and let only the job's user write {where}"
            )
        if exc.errno == errno.EISDIR:
            return ConfigError(
                f"{self.path} is a directory, where the scheduler keeps its lock file: move it "
                f"out of {where}, then start the scheduler again"
            )
        if exc.errno in (errno.EACCES, errno.EPERM) and os.path.lexists(self.path):
            return ConfigError(
                f"this process may not open {self.path}, the scheduler's lock file, for reading "
                f"and writing ({exc.strerror}): give the job's user read and write permission on "
                f"it (chmod 600 {self.path}), or remove it (the scheduler makes it again)"
            )
        space = "free space there or " if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        return ConfigError(
            f"{where} cannot hold the job's state: writing {self.path.name} failed "
            f"({exc.strerror}); {space}point MS_RECOVERY_PATH at a writable directory"
        )

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RecoveryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
