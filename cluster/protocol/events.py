"""The job's events, as the scheduler journals them and its readers read them: the kinds of
event, the causes of a failure, a `Record` (what an event says), and `JobEvent` (a record
stamped with its sequence number and wall-clock time), written as one JSON line:

    {"time": "2026-03-01T12:00:01.234+00:00", "seq": 7, "event": "failed", "rank": 2,
     "node_id": "2", "cause": "stream_broken", "reason": "...", "generation": 1}

`JobEvent.from_json` reads such a line back (`mscluster events`, the chaos report), and
`JobEvent.typed()` gives the fields of the kinds that the CLI and the metrics read as a typed
view (`Failed`, `Refused`, `GuardRefusal`, `Rejoined`, `Formed`, `Ended`, `LeaderChange`,
`MemoryResume`), checked: a field of the wrong type is an `EventFieldError` naming the event,
the field and what it holds. The line stays what it was (a view reads it, it adds no key).
Which inputs and effects of the state machine are events, and what they say, is
`cluster.scheduler.machine.events`'s to decide.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping
from dataclasses import field
from typing import Any, ClassVar, Literal

from cluster.protocol.errors import EventFieldError
from cluster.protocol.value import frozen


class Kind(enum.Enum):
    STARTED = "started"  # the scheduler serves a new job
    RESUMED = "resumed"  # a restarted scheduler took the job back from its saved state
    REGISTERED = "registered"  # a node joined (while the job forms)
    REFUSED = "refused"  # a registration was refused (reason)
    # Refused for now: its node id was alive MS_NODE_TIMEOUT ago. Once per wait: a node waiting
    # out its guard asks again every second, and those refusals are not events.
    GUARD_REFUSAL = "guard_refusal"
    FORMED = "formed"  # every node in: generation 1 published
    FAILED = "failed"  # a node failed (cause)
    REJOINED = "rejoined"  # a failed node's id is back
    GENERATION = "generation"  # a new generation published, with its rollback step
    NODES_BACK = "nodes_back"  # every node reconnected to a restarted scheduler
    SAVE_FAILED = "save_failed"  # saving the recovery state failed (said once per run)
    SAVE_RECOVERED = "save_recovered"  # a save landed again
    FINISHED = "finished"  # every node finished
    JOB_FAILED = "job_failed"  # the job ended failed
    PROMOTED = "promoted"  # a spare took a failed worker's rank: a new generation
    # With standby schedulers: this scheduler took the job's leadership (role "leader") or
    # gave it up (role "standby", with why), its address and the leader's.
    LEADER_CHANGE = "leader_change"
    # The workers resumed a new generation from the step the survivors hold in memory (not
    # from disk), as rank 0 reported it with its checkpoints.
    MEMORY_RESUME = "memory_resume"


class Cause(enum.Enum):
    """Why a node failed: a bounded set, so that it can be a metric label."""

    STREAM_BROKEN = "stream_broken"  # its Watch stream broke: the process (or link) is gone
    HEARTBEAT_SILENCE = "heartbeat_silence"  # no heartbeat for MS_NODE_TIMEOUT
    NO_RECONNECT = "no_reconnect"  # did not come back to a restarted scheduler
    REPLACED = "replaced"  # a new process took its node id while it was silent
    OTHER = "other"


# The state machine's reasons for a failure (`SchedulerState.disconnect`, `.tick`,
# `Registrar._rejoin`), by their opening words; tests/unit/test_events.py drives each path and
# checks the cause.
_CAUSES = (
    ("its connection to the scheduler broke", Cause.STREAM_BROKEN),
    ("no heartbeat for", Cause.HEARTBEAT_SILENCE),
    ("it did not reconnect within", Cause.NO_RECONNECT),
    ("a new process registered with its node id", Cause.REPLACED),
)


def failure_cause(reason: str) -> Cause:
    for opening, cause in _CAUSES:
        if reason.startswith(opening):
            return cause
    return Cause.OTHER


@frozen
class Record:
    """An event before it is stamped: what happened, and its fields (JSON values)."""

    kind: Kind
    fields: dict[str, Any] = field(default_factory=dict)


@frozen
class JobEvent:
    seq: int
    time: float  # wall clock, seconds since the epoch
    kind: str  # a Kind's value (a newer scheduler may send kinds this one does not know)
    fields: Mapping[str, Any]

    def to_json(self) -> str:
        import json  # noqa: PLC0415 - only with an event log or its followers (1.5 ms at import)

        stamp = datetime.datetime.fromtimestamp(self.time, datetime.timezone.utc)
        head = {"time": stamp.isoformat(timespec="milliseconds"), "seq": self.seq}
        return json.dumps({**head, "event": self.kind, **self.fields}, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> JobEvent:
        """The event of `line`; ValueError naming what is wrong when it is not an event line:
        a JSON object whose `seq` is a whole number (not a bool) from 0 to MAX_SEQ, `time` an
        ISO 8601 time within TIME_RANGE (no offset: UTC) and `event` a string."""
        import json  # noqa: PLC0415 - see to_json

        try:
            data = json.loads(line)
        except RecursionError:  # nested deeper than the parser goes
            raise ValueError("not an event: nested too deep to read") from None
        if not isinstance(data, dict) or not {"time", "seq", "event"} <= data.keys():
            raise ValueError("not an event: it needs time, seq and event")
        seq, kind = data.pop("seq"), data.pop("event")
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ:
            raise _no_event("seq", seq, f"a whole number 0..{MAX_SEQ}")
        if not isinstance(kind, str):
            raise _no_event("event", kind, "a string")
        return cls(seq, _timestamp(data.pop("time")), kind, data)

    def typed(self) -> View | None:
        """The typed view of this event's fields (None: a kind without one, or one this
        version does not know). EventFieldError when a field the view reads is missing or
        holds a value of another type."""
        view = _VIEWS.get(self.kind)
        return None if view is None else view.read(self)


# The largest sequence number read back (the wire's is a uint64; a journal numbers from 1).
MAX_SEQ = 2**63 - 1
# The times read back, seconds since the epoch: from 1970 to the last day of year 9999 less
# one, so that the time shown in any time zone is a date (`datetime` ends at year 9999).
TIME_RANGE = (0.0, 253402214400.0)  # 1970-01-01 .. 9999-12-30, UTC


def _timestamp(value: Any) -> float:
    """The seconds since the epoch of an event line's `time`; ValueError when it is not an
    ISO 8601 time within TIME_RANGE."""
    if not isinstance(value, str):
        raise _no_event("time", value, "a string")
    try:
        when = datetime.datetime.fromisoformat(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        stamp = when.timestamp()
    except (ValueError, OverflowError):
        raise _no_event("time", value, "an ISO 8601 time") from None
    if not TIME_RANGE[0] <= stamp < TIME_RANGE[1]:
        raise _no_event("time", value, "a time between 1970 and 9999")
    return stamp


def _no_event(name: str, value: Any, wanted: str) -> ValueError:
    """A line is no event: its field `name` holds `value` (shown short), not `wanted`."""
    shown = repr(value)
    shown = shown if len(shown) <= 40 else f"{shown[:37]}..."
    return ValueError(f"not an event: {name}={shown}, not {wanted}")


# -- typed views of the events that the CLI and the metrics read ---------------------------


def _get(event: JobEvent, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in event.fields:
        if default is not ...:
            return default
        raise EventFieldError(
            f"event {event.seq} ({event.kind}) has no field {name!r}: the scheduler that wrote "
            "it is of another version; read it with that version's mscluster"
        )
    value = event.fields[name]
    number = kind in (int, float) or (isinstance(kind, tuple) and float in kind)
    if (isinstance(value, bool) and number) or not isinstance(value, kind):
        raise EventFieldError(
            f"event {event.seq} ({event.kind}) has {name}={value!r}, not "
            f"{getattr(kind, '__name__', kind)}: the log is damaged or not an event log"
        )
    return value


def _rank(event: JobEvent) -> int | None:
    rank = _get(event, "rank", (int, type(None)), None)
    if isinstance(rank, bool) or (rank is not None and rank < 0):
        raise EventFieldError(f"event {event.seq} ({event.kind}) has rank={rank!r}, not a rank")
    return rank  # type: ignore[no-any-return]


@frozen
class Failed:
    kind: ClassVar[Kind] = Kind.FAILED
    rank: int | None  # None: it held no rank (a spare)
    node_id: str
    cause: Cause  # OTHER for a cause this version does not know
    reason: str
    generation: int

    @classmethod
    def read(cls, event: JobEvent) -> Failed:
        cause = _get(event, "cause", str)
        known = {c.value: c for c in Cause}
        return cls(
            _rank(event),
            _get(event, "node_id", str),
            known.get(cause, Cause.OTHER),
            _get(event, "reason", str, ""),
            _get(event, "generation", int, 0),
        )


@frozen
class Refused:
    """A registration refused (node_id), or a call refused at the edge (peer and method)."""

    kind: ClassVar[Kind] = Kind.REFUSED
    reason: str
    count: int  # refusals of one address this event stands for (told at a bounded rate)
    node_id: str | None

    @classmethod
    def read(cls, event: JobEvent) -> Refused:
        count = _get(event, "count", int, 1)
        return cls(_get(event, "reason", str), count, _get(event, "node_id", str, None))


@frozen
class GuardRefusal:
    kind: ClassVar[Kind] = Kind.GUARD_REFUSAL
    node_id: str
    retry_after_s: float

    @classmethod
    def read(cls, event: JobEvent) -> GuardRefusal:
        after = _get(event, "retry_after_s", (int, float), 0.0)
        return cls(_get(event, "node_id", str), float(after))


@frozen
class Rejoined:
    kind: ClassVar[Kind] = Kind.REJOINED
    node_id: str
    rank: int | None

    @classmethod
    def read(cls, event: JobEvent) -> Rejoined:
        return cls(_get(event, "node_id", str), _rank(event))


@frozen
class Formed:
    kind: ClassVar[Kind] = Kind.FORMED
    generation: int
    nodes: int
    seconds: float  # from the scheduler's start to every node in

    @classmethod
    def read(cls, event: JobEvent) -> Formed:
        seconds = float(_get(event, "seconds", (int, float)))
        return cls(_get(event, "generation", int, 1), _get(event, "nodes", int, 0), seconds)


@frozen
class Ended:
    """The job's last event: FINISHED (ok) or JOB_FAILED."""

    kind: ClassVar[Kind] = Kind.FINISHED
    ok: bool
    detail: str

    @classmethod
    def read(cls, event: JobEvent) -> Ended:
        return cls(event.kind == Kind.FINISHED.value, _get(event, "detail", str, ""))


@frozen
class LeaderChange:
    kind: ClassVar[Kind] = Kind.LEADER_CHANGE
    role: Literal["leader", "standby"]
    address: str
    term: int
    detail: str

    @property
    def leading(self) -> bool:
        return self.role == "leader"

    @classmethod
    def read(cls, event: JobEvent) -> LeaderChange:
        role = _get(event, "role", str)
        if role not in ("leader", "standby"):
            raise EventFieldError(
                f"event {event.seq} (leader_change) has role={role!r}, not leader or standby"
            )
        term = _get(event, "term", int, 0)
        return cls(role, _get(event, "address", str, ""), term, _get(event, "detail", str, ""))


@frozen
class MemoryResume:
    """Generation `generation` resumed from `step`, held in the survivors' memory (not read
    from disk); `why`: rank 0's words for the choice."""

    kind: ClassVar[Kind] = Kind.MEMORY_RESUME
    generation: int
    step: int
    why: str

    def record(self) -> Record:
        fields = {"generation": self.generation, "step": self.step, "why": self.why}
        return Record(Kind.MEMORY_RESUME, fields)

    @classmethod
    def read(cls, event: JobEvent) -> MemoryResume:
        why = _get(event, "why", str, "")
        return cls(_get(event, "generation", int), _get(event, "step", int), why)


View = Failed | Refused | GuardRefusal | Rejoined | Formed | Ended | LeaderChange | MemoryResume
_VIEWS: dict[str, Any] = {
    Kind.FAILED.value: Failed,
    Kind.REFUSED.value: Refused,
    Kind.GUARD_REFUSAL.value: GuardRefusal,
    Kind.REJOINED.value: Rejoined,
    Kind.FORMED.value: Formed,
    Kind.FINISHED.value: Ended,
    Kind.JOB_FAILED.value: Ended,
    Kind.LEADER_CHANGE.value: LeaderChange,
    Kind.MEMORY_RESUME.value: MemoryResume,
}
