"""The event log file (CLUSTER_EVENT_LOG): JSON lines appended by a thread of its own.

The scheduler's loop only puts a line in a queue; a daemon thread appends it and flushes, so a
slow or hung disk never stalls heartbeats. A disk that fails is said once (and once more when it
works again); the job goes on, its events still in memory and served by `WatchEvents`. Lines
that pile up past `MAX_QUEUED` (a disk hung for long) are dropped, and that is said once too.
A scheduler started again on the same file appends to it, numbering on from its last line.
The file rotates at CLUSTER_LOG_MAX_BYTES, CLUSTER_LOG_KEEP old ones kept (events.jsonl.1 the
newest; `cluster.storage.rotation`): an outsider's refused registrations are events too.

One scheduler writes the file at a time: the one that writes it holds an exclusive `flock` on
FILE.lock beside it (`EventLogLock`, `cluster.storage.holder_lock`; its pid, host and state
store written there), so two jobs' lines never interleave, their numbers never repeat, and
neither cuts the other's lines when it takes back a failed write. A scheduler that finds it held
by another job's scheduler, or by one of no state store, is refused at start (ConfigError).
Standbys of one job (etcd) may share the file: a standby holds nothing; the scheduler that
leads takes the lock (waiting up to `LEADER_WAIT_S` for the leader before it to let go, as
it does when it steps down) and writes the job's events from there on.

The lock is the file its path names (`holder_lock.try_lock` given the path: a file removed or
replaced between its open and its lock is opened anew). One removed or replaced while held (by
hand, with the log's other files) keeps no other scheduler out, so the writing thread checks
that the path still names its file (`EventLogLock.keep`) before each batch of lines it writes,
and every CHECK_S while it has none. Where it does not, the scheduler says so in one line and
locks the file there now, at once: then it writes on and keeps later schedulers out; where
another scheduler has locked that file since, it writes nothing more there (its events stay
in memory, served by `WatchEvents`), so the lines of two schedulers never interleave.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path

from cluster.protocol.config import LogRotation
from cluster.protocol.errors import ConfigError
from cluster.scheduler.machine.events import JobEvent
from cluster.storage import holder_lock
from cluster.storage.rotation import RotatingFile, in_order

log = logging.getLogger("cluster.scheduler")

MAX_QUEUED = 100_000
CLOSE_TIMEOUT_S = 2.0
_TAIL_BYTES = 64 * 1024
_STOP = object()
# How long a scheduler that starts to lead waits for the event log's lock, held by the
# scheduler of the same job that led before it (it lets go as it steps down, within its lease).
LEADER_WAIT_S = 15.0
# How long a scheduler starting waits for the event log's lock held by another (a scheduler
# whose launcher died ends within orphan.GRACE_S of noticing), before it is refused.
START_WAIT_S = 10.0
_LOCK_POLL_S = 0.05
# How often the writing thread, with no line to write, checks that it still holds the lock.
CHECK_S = 1.0


def last_seq(path: Path) -> int:
    """The sequence number of the last event in `path`, or in its newest old file when it has
    none yet (0: none, or unreadable)."""
    for where in reversed(in_order(path)):
        seq = _last_seq_in(where)
        if seq:
            return seq
    return 0


def _last_seq_in(path: Path) -> int:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - _TAIL_BYTES))
            lines = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return JobEvent.from_json(line).seq
        except ValueError:
            continue
    return 0


class EventLogLock:
    """FILE.lock of the event log `path`, for a scheduler of the job saved at `state` (its state
    store's place; '' without one): `claim` at start, `hold` to write, `release`."""

    def __init__(self, path: Path, state: str = "") -> None:
        self.path = path
        self.state = state
        # Unlockable when lost: it writes on without the lock, as at start (said once).
        self._hold = holder_lock.Hold(
            holder_lock.lock_path(path), retry=False, open_file=_open_making_parent, state=state
        )
        self._open_lock = threading.Lock()
        self.holder: dict[str, object] = {}  # what the holder wrote, when another holds it
        self._said = False

    @property
    def held(self) -> bool:
        return self._hold.fd is not None

    def claim(self, *, standby: bool = False) -> None:
        """At start: hold the lock from now on (a standby only checks that it could), or a
        ConfigError when a scheduler of another job (or of none) holds it for START_WAIT_S
        more. One of this job (a standby's leader, a leader a restarted scheduler finds) is
        left to it."""
        taken = self._take()
        if taken is False and not (self.state and self.holder.get("state") == self.state):
            log.info(
                "the event log %s is written by another scheduler (%s): waiting up to %g s "
                "for it to end",
                self.path,
                _described(self.holder),
                START_WAIT_S,
            )
            if not self.hold(START_WAIT_S, threading.Event()):
                raise ConfigError(
                    f"CLUSTER_EVENT_LOG={str(self.path)!r} is written by another scheduler "
                    f"({_described(self.holder)}), whose events this one's would mix with: "
                    "give each job its own event log (mscluster run: its own --log-dir), or "
                    "stop that scheduler first"
                )
            taken = True
        if taken and standby:
            self.release()

    def hold(self, wait_s: float, stop: threading.Event) -> bool:
        """Hold the lock, waiting up to `wait_s` (or until `stop`) for its holder to let go;
        True when held (or when the file system has no locks: nothing to hold)."""
        deadline = time.monotonic() + wait_s
        while not self.held:
            taken = self._take()
            if taken is None or taken:
                return True
            if time.monotonic() >= deadline or stop.wait(_LOCK_POLL_S):
                return False
        return True

    def keep(self) -> bool:
        """Whether this scheduler may write on: True while the path names the lock file it
        holds (or it holds none). Where that file was removed or replaced, its lock is let go
        and the file there now locked at once (`holder_lock.Hold.keep`), said in one line: True
        when taken (or when it cannot be: said as at start), False when another scheduler has
        locked it since."""
        with self._open_lock:
            found = self._hold.keep()
        if found is None:
            return True
        where = self._hold.path
        if found.holder is not None:
            self.holder = found.holder
            log.error(
                "%s was removed or replaced while this scheduler held it, and another "
                "scheduler (%s) has locked the file there since: this scheduler's events are "
                "not written to %s from now on; mscluster events --addr has them",
                where,
                _described(self.holder),
                self.path,
            )
            return False
        if found.error is not None:
            self._unlockable(where, found.error)
        log.warning(
            "%s was removed or replaced while this scheduler held it, so its lock kept no "
            "other scheduler from writing %s: locked the file there anew",
            where,
            self.path,
        )
        return True

    def release(self) -> None:
        with self._open_lock:
            self._hold.release()  # the file stays (`holder_lock`)

    def _take(self) -> bool | None:
        """True: held now (or already); False: another holds it (`_holder`); None: it cannot
        be taken here (said once), and nothing keeps another scheduler out."""
        with self._open_lock:
            if self._hold.fd is not None:
                return True
            try:
                holder = self._hold.open_and_lock()
            except OSError as exc:
                self._unlockable(self._hold.path, exc)
                return None
            if holder is not None:
                self.holder = holder
                return False
            return True

    def _unlockable(self, where: Path, exc: OSError) -> None:
        if not self._said:
            self._said = True
            log.warning(
                "cannot lock the event log's %s (%s): nothing keeps another scheduler from "
                "writing %s",
                where,
                exc.strerror or exc,
                self.path,
            )


def _open_making_parent(where: Path) -> int:
    """The lock file `where` open (`holder_lock.open_lock`), its directory made first."""
    where.parent.mkdir(parents=True, exist_ok=True)
    return holder_lock.open_lock(where)


def _described(holder: dict[str, object]) -> str:
    """The holder of the event log's lock: its process, and the job's state store."""
    state = holder.get("state")
    job = f"for the job in {state}" if state else "without a state store"
    return f"{holder_lock.described(holder)}, {job}"


class EventFile:
    """Appends lines to `path` on a thread, rotated as `rotation` says; `write` never blocks.
    With `lock`, the thread holds it before its first write (`EventLogLock.hold`), checks it
    before each batch of lines and every CHECK_S while idle (`EventLogLock.keep`), and lets it
    go when it ends."""

    def __init__(
        self, path: Path, rotation: LogRotation | None = None, lock: EventLogLock | None = None
    ) -> None:
        self.path = path
        self._lock = lock
        self._stopping = threading.Event()
        self._file = RotatingFile(path, rotation or LogRotation())
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._queued = 0  # approximate: read and written without a lock, for the bound only
        self._failing = False
        self._dropping = False
        self._thread = threading.Thread(target=self._run, name="cluster-event-log", daemon=True)
        self._thread.start()

    def write(self, line: str) -> None:
        if self._queued >= MAX_QUEUED:
            if not self._dropping:
                self._dropping = True
                log.error(
                    "the event log %s is %d lines behind (its disk hangs?): dropping events "
                    "from it until it catches up; mscluster events --addr still has them",
                    self.path,
                    self._queued,
                )
            return
        self._dropping = False
        self._queued += 1
        self._queue.put(line)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued (for up to `timeout_s`), then stop the thread and let the lock
        go."""
        self._stopping.set()
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        if self._lock is not None:
            self._lock.release()

    def _run(self) -> None:
        lock = self._lock
        if lock is not None and not lock.hold(LEADER_WAIT_S, self._stopping):
            self._locked_out(lock)
            return
        while True:
            batch = self._queue.empty()  # the line next is the first of a batch
            try:
                item = self._queue.get(timeout=CHECK_S)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if item is not None:
                self._queued -= 1
            if (batch or item is None) and lock is not None and not lock.keep():
                self._file.close()
                self._drain()  # another scheduler writes the file now (said)
                return
            if item is not None:
                self._append(str(item))
        self._file.close()

    def _append(self, line: str) -> None:
        try:
            self._file.write(f"{line}\n".encode())
        except OSError as exc:
            self._failed(exc)
            return
        if self._failing:
            self._failing = False
            log.info("the event log %s is written again", self.path)

    def _locked_out(self, lock: EventLogLock) -> None:
        """Another scheduler kept the event log: this one's events are not written there."""
        if not self._stopping.is_set():
            log.error(
                "the event log %s is written by another scheduler (%s): this scheduler's "
                "events are not written there; mscluster events --addr has them",
                self.path,
                _described(lock.holder),
            )
        self._drain()

    def _drain(self) -> None:
        """Take the lines written from now on, and write none, until `close`."""
        while self._queue.get() is not _STOP:
            self._queued -= 1

    def _failed(self, exc: OSError) -> None:
        if not self._failing:
            self._failing = True
            log.error(
                "cannot write the event log %s (%s): the job goes on, and its events stay "
                "available through `mscluster events --addr`",
                self.path,
                exc.strerror or exc,
            )
        self._file.close()
