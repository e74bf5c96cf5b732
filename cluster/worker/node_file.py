"""A worker's own recovery file: the job it belongs to, its node id and its rank.

It sits beside the scheduler's state under MS_RECOVERY_PATH (on the worker's host), one file per
node id. A restarted process reads it to present its old job id, so that a scheduler running
another job (a new one, after its state was lost) refuses it instead of mixing two jobs; when
the node has finished its part, the file says so and a new start is a new job's node.

One live process per node id and directory (`NodeLock`): a worker holds an exclusive `flock` on
`worker-<id>.lock` beside its record before it reads the record, until it finalizes or its process
ends. Two jobs may give one directory to their workers on a host that runs only workers (no
scheduler's lock covers it): a worker of the second job must neither present the first's live
record nor write over the record the first job's restarted worker loads. The kernel drops the lock
of a process that ends, however it ends (SIGKILL included), so a restarted worker takes it at once;
a second live process is refused at init() with one line naming the directory, the lock file, the
holder (pid, host, the job once known) and what to do. The holder writes who it is into the lock
file. The descriptor is not inherited (O_CLOEXEC) and a forked child closes its copy at once, so no
child keeps the lock after the worker is gone. The file stays when released: removing it would let
a newcomer lock a new file while another locks the old one. It is opened without following a link
(`atomic`) and written only when it is this user's own regular file with one name. Where the lock
cannot be taken (a file system without locks: ENOLCK), the worker goes on without it, saying so
once (on a read-only file system, where no record can be written either, it says nothing).

The lock is the file its path names (`holder_lock.try_lock` given the path: a file removed or
replaced between its open and its lock is opened anew). One removed or replaced while held (by
hand, with the directory's other files) keeps no other process of the node id out, so before
the worker writes its record (`NodeLock.keep`) it checks that the path still names its file.
Where it does not, the lock is let go and the file there now locked at once: the worker says so
in one line and writes its record; where another process has locked that file since, it writes
no record (a ConfigError naming that process: the record is the other's now), and trains on.
"""

from __future__ import annotations

import errno
from dataclasses import asdict
from pathlib import Path

from cluster.protocol.errors import ConfigError, StateFileError
from cluster.protocol.value import frozen
from cluster.storage import atomic, holder_lock, store

KIND = "worker"


@frozen
class NodeRecord:
    cluster_id: str
    node_id: str
    rank: int
    generation: int
    finished: bool = False


def path_for(directory: Path, node_id: str) -> Path:
    return directory / f"worker-{node_id}.json"


def lock_path_for(directory: Path, node_id: str) -> Path:
    return directory / f"worker-{node_id}.lock"


def load(directory: Path, node_id: str) -> NodeRecord | None:
    path = path_for(directory, node_id)
    payload = store.load(path, KIND)
    if payload is None:
        return None
    try:
        record = NodeRecord(
            cluster_id=str(payload["cluster_id"]),
            node_id=str(payload["node_id"]),
            rank=int(payload["rank"]),
            generation=int(payload["generation"]),
            finished=bool(payload["finished"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise StateFileError(
            f"the recovery state {path} lacks or garbles {exc}: move it away to start this node "
            "as a new one"
        ) from None
    if record.node_id != node_id:
        raise StateFileError(
            f"the recovery state {path} belongs to node {record.node_id!r}, not {node_id!r}: "
            "move it away"
        )
    return record


def save(directory: Path, record: NodeRecord) -> None:
    store.save(path_for(directory, record.node_id), KIND, asdict(record))


ADVICE = "give each job its own MS_RECOVERY_PATH (mscluster run --recovery-path)"


class NodeLock:
    """This process's hold on the record of node `node_id` in `directory`: `take` before the
    record is read, `tell` the job once known, `release` at the end."""

    def __init__(self, directory: Path, node_id: str) -> None:
        self.directory = directory
        self.node_id = node_id
        self.path = lock_path_for(directory, node_id)
        # Unlockable when lost: it goes on without the lock, as at `take`. A forked child
        # closes its copy at once, so that no child keeps the lock after the worker is gone.
        self._hold = holder_lock.Hold(self.path, retry=False, fork_safe=True, job="")

    def take(self) -> str:
        """Lock the node's record, or a ConfigError naming the holder when another live process
        holds it. Returns '' or, where the lock cannot be taken (no locks on this file system),
        the line to say: the worker goes on without it."""
        try:
            fd = self._open()
        except OSError as exc:
            # Read-only: no record can be written there either, nothing to keep apart.
            return "" if exc.errno == errno.EROFS else self._without(exc)
        try:
            holder = self._hold.lock(fd)
        except OSError as exc:  # ENOLCK, ENOSYS, EOPNOTSUPP: no locks on this file system
            return self._without(exc)
        if holder is not None:
            raise ConfigError(self._refusal(holder))
        return ""

    def keep(self) -> str:
        """Before the record is written: '' while the path names the file this process locked
        (or it holds none: no locks here). Where that file was removed or replaced, the lock is
        let go and the file there now locked at once (`holder_lock.Hold.keep`): the line to
        say; a ConfigError naming the process that has locked it since (each later `keep` tries
        again)."""
        found = self._hold.keep()
        if found is None:
            return ""
        lost = f"{self.path} was removed or replaced while this worker held it"
        if found.holder is not None:
            raise ConfigError(f"{lost}, and {self._refusal(found.holder)}")
        if found.error is not None:
            return (
                f"{lost}, and cannot be locked anew ({found.cause}): nothing keeps another "
                f"job's node {self.node_id!r} off its record; {ADVICE}"
            )
        return (
            f"{lost}, so it kept no other process of this node id out: locked the file there anew"
        )

    def tell(self, job: str) -> None:
        """Write the holder (this process, in job `job` when known) into the lock file; a
        failure is harmless (a refused newcomer then names less)."""
        self._hold.tell(job=job)

    def release(self) -> None:
        self._hold.release()  # the lock goes with it

    def _open(self) -> int:
        """The lock file, open for reading and writing; OSError, or ConfigError when a link or
        a file not of this user's own is in its place."""
        fd, unfit = atomic.open_own(self.path)
        if fd is not None:
            return fd
        raise ConfigError(
            f"{self.path} is {unfit}: it was not made by a worker of this user, and is never "
            "followed or written; remove it, and let only the job's user write "
            f"MS_RECOVERY_PATH={str(self.directory)!r}"
        )

    def _without(self, exc: OSError) -> str:
        return (
            f"cannot lock {self.path} ({exc.strerror}): this worker goes on without the lock, "
            f"and nothing keeps another job's node {self.node_id!r} off its record in "
            f"MS_RECOVERY_PATH={str(self.directory)!r}; {ADVICE}"
        )

    def _refusal(self, holder: dict[str, object]) -> str:
        job = holder.get("job")
        who = holder_lock.described(holder) + (f", job {job}" if job else "")
        return (
            f"node {self.node_id!r} is already running on MS_RECOVERY_PATH="
            f"{str(self.directory)!r} ({who} holds {self.path.name}): two processes of one "
            "node id there would take each other's record and fail each other's job; "
            f"{ADVICE}, or stop that process first"
        )
