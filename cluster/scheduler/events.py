"""The scheduler's journal: every change of the job as an event, kept, followed and logged.

The core hands in what happened (a registration and its outcome, an effect it has just told the
nodes, every node back after a restart, a save failing); `cluster.scheduler.machine.events` decides
whether that is an event and what it says; the journal stamps it (sequence number, wall-clock time),
keeps the last `RETAINED_EVENTS`, hands it to its listeners (the metrics), to every `WatchEvents`
stream, and to the event log file when there is one. It never blocks: the file is written by a
thread of its own (`cluster.scheduler.event_file`), and a stream that falls `FOLLOWER_BACKLOG`
events or the job's `follower_max_bytes` behind is ended: what it had waiting is dropped, and its
next read is the FellBehindError (it can reconnect with the last number it got). At most
`max_followers` streams are open at once, following or not, each counted until its reader has
read its end or gone (so readers that never read hold at most that many times their bytes, or
the retained events they asked for; CLUSTER_MAX_FOLLOWERS, CLUSTER_FOLLOWER_MAX_BYTES). A
scheduler that stops leading the job ends every following stream with the error that names the
leader (`fail`): its journal hears nothing more."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.protocol.config import LogRotation, canonical_node_id
from cluster.protocol.errors import CapacityError, ClusterError, FellBehindError
from cluster.scheduler.machine import events, state
from cluster.scheduler.machine.events import JobEvent, Kind, MemoryResume, Record

if TYPE_CHECKING:
    from cluster.scheduler.event_file import EventFile, EventLogLock

# Events kept in memory for `WatchEvents` (a 1024-node job's registrations fit twice).
RETAINED_EVENTS = 4096
# Events a `WatchEvents` stream may be behind before it is ended.
FOLLOWER_BACKLOG = 10_000
# The job's last events: a following stream ends after one.
FINAL = frozenset({Kind.FINISHED.value, Kind.JOB_FAILED.value})
_BEHIND = (
    f"this event stream fell behind (over {FOLLOWER_BACKLOG} events or "
    "CLUSTER_FOLLOWER_MAX_BYTES waiting) and was ended; read faster, or "
    "reconnect asking for the events after the last one you got"
)


class _Follower:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[JobEvent, int] | None] = asyncio.Queue()
        self.error: ClusterError | None = None  # how the stream ends once `queue` says None
        self.waiting_bytes = 0  # of the events in `queue`


class EventJournal:
    def __init__(
        self,
        st: state.SchedulerState,
        wall: Callable[[], float] = time.time,
        retain: int = RETAINED_EVENTS,
    ) -> None:
        self._state = st
        self._wall = wall
        self._events: deque[JobEvent] = deque(maxlen=retain)
        self.seq = 0
        self._file: EventFile | None = None
        self._followers: set[_Follower] = set()  # the streams each new event goes to
        self._failed: ClusterError | None = None  # set by `fail`: no stream follows any more
        # Every stream open, following or not, ended or not, until its generator exits: a
        # reader that never reads is held at a yield by gRPC's flow control, with what its
        # stream holds, for as long as its call lasts.
        self._streams = 0
        self._saves_failing = False
        self.last_memory_resume: MemoryResume | None = None  # for Status
        # Called with every event, on the loop (the metrics count them).
        self.listeners: list[Callable[[JobEvent], None]] = []
        # Effects journaled ahead of their telling (`effect_ahead`): not journaled again.
        self._ahead: list[state.Effect] = []

    # -- what happened -------------------------------------------------------------------------

    def incarnation_of(self, node_id: str) -> int | None:
        """The incarnation the node has now (None: not a member); taken before a registration."""
        member = self._state.find(canonical_node_id(node_id))
        return None if member is None else member.incarnation

    def registration(
        self,
        reg: state.Registration,
        prior_incarnation: int | None,
        outcome: state.Accepted | state.Refused,
        *,
        was_waiting: bool = False,
        count: int = 1,
    ) -> None:
        """`count`: refusals of the caller's address this one stands for (told at a bounded
        rate, `cluster.scheduler.refusals`)."""
        record = events.of_registration(
            reg, prior_incarnation, outcome, self._state, was_waiting=was_waiting
        )
        if record is not None:
            if count > 1:
                record.fields["count"] = count
            self.emit(record)

    def effect(self, effect: state.Effect) -> None:
        if effect in self._ahead:
            self._ahead.remove(effect)
            return
        record = events.of_effect(effect, self._state)
        if record is not None:
            self.emit(record)

    def effect_ahead(self, effect: state.Effect) -> None:
        """Journal `effect` now, before what follows it here is journaled, though it is told
        (and sent) only once saved: a new process that takes a silent node's id fails that
        node's process (cause `replaced`), and its `rejoined` must come after that `failed`
        in the journal, as it did in the job. Its telling journals nothing more."""
        self._ahead.append(effect)
        record = events.of_effect(effect, self._state)
        if record is not None:
            self.emit(record)

    def memory_resume(self, node_id: str, resumed: MemoryResume) -> None:
        """Rank 0 reported that the current generation resumed from memory: journaled once
        per generation, and kept as the last one for Status."""
        news = events.of_memory_resume(self._state, node_id, resumed, self.last_memory_resume)
        if news is not None:
            self.last_memory_resume = news
            self.emit(news.record())

    def nodes_back(self, seconds: float) -> None:
        self.emit(Record(Kind.NODES_BACK, {"seconds": round(seconds, 3)}))

    def save(self, ok: bool, error: str = "") -> None:
        """A save of the recovery state ended: said when saves start and stop failing."""
        if ok and self._saves_failing:
            self._saves_failing = False
            self.emit(Record(Kind.SAVE_RECOVERED))
        elif not ok and not self._saves_failing:
            self._saves_failing = True
            self.emit(Record(Kind.SAVE_FAILED, {"error": error}))

    def emit(self, record: Record) -> JobEvent:
        self.seq += 1
        event = JobEvent(self.seq, self._wall(), record.kind.value, record.fields)
        self._events.append(event)
        for listener in self.listeners:
            listener(event)
        line = event.to_json() if self._file is not None or self._followers else ""
        if self._file is not None:
            self._file.write(line)
        if self._followers:
            size = len(line)
            most = self._state.settings.limits.follower_max_bytes
            for follower in list(self._followers):
                if (
                    follower.queue.qsize() >= FOLLOWER_BACKLOG
                    or follower.waiting_bytes + size > most
                ):
                    self._fell_behind(follower)
                else:
                    follower.waiting_bytes += size
                    follower.queue.put_nowait((event, size))
        return event

    # -- the log file --------------------------------------------------------------------------

    def open(
        self, path: Path, rotation: LogRotation | None = None, lock: EventLogLock | None = None
    ) -> None:
        """Append every event from now on to `path` (rotated as `rotation` says, written once
        `lock` is held), numbered on from its last one."""
        # Only with an event log (CLUSTER_EVENT_LOG): files, rotation, random names.
        from cluster.scheduler.event_file import EventFile, last_seq  # noqa: PLC0415

        self.seq = max(self.seq, last_seq(path))
        self._file = EventFile(path, rotation, lock)

    def _end(self, follower: _Follower, error: ClusterError | None = None) -> None:
        """End a following stream: well (None), or with `error`, after what it has waiting."""
        follower.error = error
        self._followers.discard(follower)
        follower.queue.put_nowait(None)

    def _fell_behind(self, follower: _Follower) -> None:
        """End a stream too far behind: what it has waiting is dropped (its reader may not
        read for as long as its call lasts), so that its next read is the FellBehindError."""
        while not follower.queue.empty():
            follower.queue.get_nowait()
        follower.waiting_bytes = 0
        self._end(follower, FellBehindError(_BEHIND))

    def fail(self, error: ClusterError) -> None:
        """This journal hears nothing more (its scheduler no longer leads the job): every
        following stream ends with `error`, and so does any that asks to follow from now on."""
        self._failed = error
        for follower in list(self._followers):
            self._end(follower, error)
        self._close_file()  # what it heard is written out, and the event log's lock let go

    def close(self) -> None:
        """End every following stream and write out the file."""
        for follower in list(self._followers):
            self._end(follower)
        self._close_file()

    def _close_file(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()

    # -- readers -------------------------------------------------------------------------------

    def history(self, after: int = 0) -> list[JobEvent]:
        """The retained events numbered above `after`, oldest first."""
        return [e for e in self._events if e.seq > after]

    def _admit(self, following: bool) -> None:
        """Refuse a reader past CLUSTER_MAX_FOLLOWERS, and a follower once nothing more is heard."""
        if following and self._failed is not None:
            raise self._failed
        most = self._state.settings.limits.max_followers
        if self._streams >= most:
            raise CapacityError(
                f"{most} readers of this job's events are connected already, the most it takes "
                "(CLUSTER_MAX_FOLLOWERS, which counts every WatchEvents stream until it is "
                "read to its end): stop another reader, or try again"
            )

    async def follow(self, after: int = 0, *, follow: bool = True) -> AsyncIterator[JobEvent]:
        """The retained events after `after`, then (with `follow`) each new one, until the job's
        last event or the journal's close. FellBehindError when the reader is too slow; the
        error given to `fail` once the journal hears nothing more."""
        follower = _Follower()
        past = self.history(after)
        following = follow and not any(e.kind in FINAL for e in past)
        self._admit(following)
        if following:
            self._followers.add(follower)  # in the same step as the history: nothing missed
        self._streams += 1
        try:
            for event in past:
                yield event
            if not following:
                return
            while True:
                item = await follower.queue.get()
                if item is None:
                    if follower.error is not None:
                        raise follower.error
                    return
                news, size = item
                follower.waiting_bytes -= size
                yield news
                if news.kind in FINAL:
                    return
        finally:
            self._followers.discard(follower)
            self._streams -= 1
