"""The job's history as events: what the state machine decided, named and put in records.

Pure: the scheduler's journal (`cluster.scheduler.events`) hands in a registration and its
outcome, or an effect of the state machine, and gets back the record to log (or None: a
progress count, a retried registration, an eviction are not changes of the job). It stamps each
record with a sequence number and the wall-clock time, and writes it as one JSON line:

    {"time": "2026-03-01T12:00:01.234+00:00", "seq": 7, "event": "failed", "rank": 2,
     "node_id": "2", "cause": "stream_broken", "reason": "...", "generation": 1}

`JobEvent.from_json` reads such a line back (`mscluster events`, the chaos report).
"""

from __future__ import annotations

import datetime
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.protocol.config import canonical_node_id
from cluster.scheduler.machine import state


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


def of_registration(
    reg: state.Registration,
    prior_incarnation: int | None,
    outcome: state.Accepted | state.Refused,
    st: state.SchedulerState,
    *,
    was_waiting: bool = False,
) -> Record | None:
    """The event of a registration; `prior_incarnation`: the node's before it (None: not a
    member); `was_waiting`: the node was waiting out its guard before it (its refusal again is
    no event). A retry of the same process is no event."""
    node_id = canonical_node_id(reg.node_id)
    if isinstance(outcome, state.Refused):
        if outcome.reason is state.Refusal.NODE_ALIVE:
            if was_waiting:
                return None
            return Record(
                Kind.GUARD_REFUSAL,
                {"node_id": node_id, "retry_after_s": round(outcome.retry_after_s, 3)},
            )
        return Record(
            Kind.REFUSED,
            {"node_id": node_id, "reason": outcome.reason.value, "message": outcome.message},
        )
    member = st.find(node_id)
    if outcome.rejoined:
        return Record(
            Kind.REJOINED,
            {
                "node_id": node_id,
                "rank": None if member is None else member.rank,
                "restarts": 0 if member is None else member.restarts,
                "address": f"{reg.host}:{reg.port}",
            },
        )
    if prior_incarnation == reg.incarnation:
        return None
    return Record(
        Kind.REGISTERED,
        {
            "node_id": node_id,
            "role": reg.role.value,
            "address": f"{reg.host}:{reg.port}",
            "registered": outcome.registered,
            "expected": outcome.expected,
            **({"replaced": True} if prior_incarnation is not None else {}),
            **({"spare": True} if outcome.spare else {}),
        },
    )


def of_effect(effect: state.Effect, st: state.SchedulerState) -> Record | None:
    """The event of an effect the scheduler has just applied (told the nodes)."""
    if isinstance(effect, state.TopologyReadyEvent):
        if effect.generation == 1:
            return Record(
                Kind.FORMED,
                {
                    "generation": 1,
                    "nodes": len(effect.peers),
                    "seconds": round(st.clock() - st.started, 3),
                },
            )
        if effect.promoted:
            promoted = st.find(effect.promoted)
            return Record(
                Kind.PROMOTED,
                {
                    "node_id": effect.promoted,
                    "rank": None if promoted is None else promoted.rank,
                    "generation": effect.generation,
                    "rollback_step": effect.rollback_step,
                    "reason": effect.reason,
                },
            )
        return Record(
            Kind.GENERATION,
            {
                "generation": effect.generation,
                "rollback_step": effect.rollback_step,
                "reason": effect.reason,
            },
        )
    if isinstance(effect, state.NodeFailedEvent):
        return Record(
            Kind.FAILED,
            {
                "rank": None if effect.rank < 0 else effect.rank,
                "node_id": effect.node_id,
                "cause": failure_cause(effect.reason).value,
                "reason": effect.reason,
                "generation": effect.generation,
            },
        )
    if isinstance(effect, state.ShutdownEvent):
        return Record(Kind.FINISHED if effect.ok else Kind.JOB_FAILED, {"detail": effect.reason})
    return None  # progress counts and evictions are not changes of the job


def of_start(st: state.SchedulerState) -> Record:
    """The scheduler's first event: a new job, or one resumed from its saved state."""
    fields: dict[str, Any] = {
        "cluster_id": st.cluster_id,
        "worker_num": st.settings.worker_num,
        "server_num": st.settings.server_num,
        "recovery": st.recovery,
    }
    if st.phase is state.Phase.READY:
        fields.update(generation=st.generation, awaiting=len(st.awaiting))
        return Record(Kind.RESUMED, fields)
    return Record(Kind.STARTED, fields)


# -- the stamped event, as a JSON line -------------------------------------------------------


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


def of_leader_change(leading: bool, address: str, term: int, why: str = "") -> Record:
    """This scheduler (at `address`) took the job's leadership (its `term`-th), or let it go."""
    fields: dict[str, Any] = {"role": "leader" if leading else "standby", "address": address}
    fields["term"] = term
    if why:
        fields["detail"] = why
    return Record(Kind.LEADER_CHANGE, fields)
