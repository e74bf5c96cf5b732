"""The event log file (CLUSTER_EVENT_LOG): JSON lines appended by a thread of its own.

The scheduler's loop only puts a line in a queue; a daemon thread appends it and flushes, so a
slow or hung disk never stalls heartbeats. A disk that fails is said once (and once more when it
works again); the job goes on, its events still in memory and served by `WatchEvents`. Lines
that pile up past `MAX_QUEUED` (a disk hung for long) are dropped, and that is said once too.
A scheduler started again on the same file appends to it, numbering on from its last line.
The file rotates at CLUSTER_LOG_MAX_BYTES, CLUSTER_LOG_KEEP old ones kept (events.jsonl.1 the
newest; `cluster.storage.rotation`): an outsider's refused registrations are events too.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from pathlib import Path

from cluster.protocol.config import LogRotation
from cluster.scheduler.machine.events import JobEvent
from cluster.storage.rotation import RotatingFile, in_order

log = logging.getLogger("cluster.scheduler")

MAX_QUEUED = 100_000
CLOSE_TIMEOUT_S = 2.0
_TAIL_BYTES = 64 * 1024
_STOP = object()


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


class EventFile:
    """Appends lines to `path` on a thread, rotated as `rotation` says; `write` never blocks."""

    def __init__(self, path: Path, rotation: LogRotation | None = None) -> None:
        self.path = path
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
        """Write what is queued (for up to `timeout_s`), then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            self._queued -= 1
            try:
                self._file.write(f"{item}\n".encode())
            except OSError as exc:
                self._failed(exc)
                continue
            if self._failing:
                self._failing = False
                log.info("the event log %s is written again", self.path)
        self._file.close()

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
