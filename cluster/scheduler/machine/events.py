"""The job's history as events: what the state machine decided, named and put in records.

Pure: the scheduler's journal (`cluster.scheduler.events`) hands in a registration and its
outcome, or an effect of the state machine, and gets back the record to log (or None: a
progress count, a retried registration, an eviction are not changes of the job). It stamps each
record with a sequence number and the wall-clock time (`cluster.protocol.events.JobEvent`).
"""

from __future__ import annotations

from typing import Any

from cluster.protocol.config import canonical_node_id
from cluster.protocol.events import Cause, JobEvent, Kind, MemoryResume, Record, failure_cause
from cluster.protocol.records import NodeRole
from cluster.scheduler.machine import state


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
                "rank": effect.rank,
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


# The most of a memory resume's `why` kept (rank 0's words; the request is bounded in bytes).
WHY_MAX = 512


def of_memory_resume(
    st: state.SchedulerState, node_id: str, resumed: MemoryResume, last: MemoryResume | None
) -> MemoryResume | None:
    """The memory resume to journal of rank 0's report (`last`: the one journaled before), or
    None: a report of another rank, of another generation than the current one, or one
    journaled already (a retried report) is no event."""
    member = st.find(canonical_node_id(node_id))
    if member is None or member.rank != 0 or member.role is not NodeRole.WORKER:
        return None
    if resumed.generation != st.generation or resumed.step < 0:
        return None
    if last is not None and last.generation >= resumed.generation:
        return None
    return MemoryResume(resumed.generation, resumed.step, resumed.why[:WHY_MAX])


def of_leader_change(leading: bool, address: str, term: int, why: str = "") -> Record:
    """This scheduler (at `address`) took the job's leadership (its `term`-th), or let it go."""
    fields: dict[str, Any] = {"role": "leader" if leading else "standby", "address": address}
    fields["term"] = term
    if why:
        fields["detail"] = why
    return Record(Kind.LEADER_CHANGE, fields)


__all__ = [
    "Cause",
    "JobEvent",
    "Kind",
    "MemoryResume",
    "Record",
    "failure_cause",
    "of_effect",
    "of_leader_change",
    "of_memory_resume",
    "of_registration",
    "of_start",
]
