"""The job's events, as the scheduler journals them and its readers read them: the kinds of
event, the causes of a failure, a `Record` (what an event says), and `JobEvent` (a record
stamped with its sequence number and wall-clock time), written as one JSON line:

    {"time": "2026-03-01T12:00:01.234+00:00", "seq": 7, "event": "failed", "rank": 2,
     "node_id": "2", "cause": "stream_broken", "reason": "...", "generation": 1}

`JobEvent.from_json` reads such a line back (`mscluster events`, the chaos report). Which
inputs and effects of the state machine are events, and what they say, is
`cluster.scheduler.machine.events`'s to decide.
"""

from __future__ import annotations

import datetime
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


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


class Cause(enum.Enum):
    """Why a node failed: a bounded set, so that it can be a metric label."""

    STREAM_BROKEN = "stream_broken"  # its Watch stream broke: the process (or link) is gone
    HEARTBEAT_SILENCE = "heartbeat_silence"  # no heartbeat for MS_NODE_TIMEOUT
    NO_RECONNECT = "no_reconnect"  # did not come back to a restarted scheduler
    REPLACED = "replaced"  # a new process took its node id while it was silent
    OTHER = "other"


# The state machine's reasons for a failure (`SchedulerState.disconnect`, `.tick`, `._rejoin`),
# by their opening words; tests/unit/test_events.py drives each path and checks the cause.
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


@dataclass(frozen=True)
class Record:
    """An event before it is stamped: what happened, and its fields (JSON values)."""

    kind: Kind
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JobEvent:
    seq: int
    time: float  # wall clock, seconds since the epoch
    kind: str  # a Kind's value (a newer scheduler may send kinds this one does not know)
    fields: Mapping[str, Any]

    def to_json(self) -> str:
        stamp = datetime.datetime.fromtimestamp(self.time, datetime.timezone.utc)
        head = {"time": stamp.isoformat(timespec="milliseconds"), "seq": self.seq}
        return json.dumps({**head, "event": self.kind, **self.fields}, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> JobEvent:
        """ValueError when `line` is not an event line."""
        data = json.loads(line)
        if not isinstance(data, dict) or not {"time", "seq", "event"} <= data.keys():
            raise ValueError("not an event: it needs time, seq and event")
        when = datetime.datetime.fromisoformat(str(data.pop("time")))
        return cls(int(data.pop("seq")), when.timestamp(), str(data.pop("event")), data)
