"""State-machine records <-> protobuf messages, in one place."""

from __future__ import annotations

import zlib

from cluster.protocol import auth
from cluster.protocol.errors import ClusterError, CollectiveMismatchError, PeerFinishedError
from cluster.protocol.leadership import Standing
from cluster.scheduler.machine import state
from cluster.scheduler.machine.events import JobEvent, MemoryResume
from cluster.scheduler.persist import Saving
from cluster.transport import failures
from cluster.v1 import scheduler_pb2 as pb

# What the scheduler writes on an idle stream.
HEARTBEAT = pb.Event(heartbeat=pb.SchedulerHeartbeat()).SerializeToString()

# A whole peer table larger than this (about 170 nodes) travels compressed; smaller ones are not
# worth a step. Level 6: 3 to 6 times smaller, 5 ms for 8,192 nodes, once per generation.
COMPRESS_TABLE_ABOVE = 4096
TABLE_ZLIB_LEVEL = 6

_ROLE_TO_PB = {state.NodeRole.WORKER: pb.ROLE_WORKER, state.NodeRole.SERVER: pb.ROLE_SERVER}
_ROLE_FROM_PB: dict[int, state.NodeRole] = {int(v): k for k, v in _ROLE_TO_PB.items()}
PHASE_TO_PB = {
    state.Phase.WAITING: pb.PHASE_WAITING,
    state.Phase.READY: pb.PHASE_READY,
    state.Phase.FINISHED: pb.PHASE_FINISHED,
    state.Phase.FAILED: pb.PHASE_FAILED,
}
NODE_STATE_TO_PB = {
    state.NodeState.ALIVE: pb.NODE_STATE_ALIVE,
    state.NodeState.FAILED: pb.NODE_STATE_FAILED,
    state.NodeState.FINISHED: pb.NODE_STATE_FINISHED,
}
_REFUSAL_TO_PB = {
    state.Refusal.CLUSTER_FULL: pb.REFUSAL_CLUSTER_FULL,
    state.Refusal.WORKER_NUM_MISMATCH: pb.REFUSAL_WORKER_NUM_MISMATCH,
    state.Refusal.FOREIGN_JOB: pb.REFUSAL_FOREIGN_JOB,
    state.Refusal.INVALID_NODE: pb.REFUSAL_INVALID_NODE,
    state.Refusal.JOB_OVER: pb.REFUSAL_JOB_OVER,
    state.Refusal.NOT_A_MEMBER: pb.REFUSAL_NOT_A_MEMBER,
    state.Refusal.UNAUTHENTICATED: pb.REFUSAL_UNAUTHENTICATED,
    state.Refusal.NODE_ALIVE: pb.REFUSAL_NODE_ALIVE,
    state.Refusal.JOB_FINISHED: pb.REFUSAL_JOB_FINISHED,
    state.Refusal.STALE_CHALLENGE: pb.REFUSAL_STALE_CHALLENGE,
    state.Refusal.VERSION_MISMATCH: pb.REFUSAL_VERSION_MISMATCH,
}


def role_from_pb(role: int) -> state.NodeRole | None:
    return _ROLE_FROM_PB.get(int(role))


def role_to_pb(role: state.NodeRole) -> pb.Role:
    return _ROLE_TO_PB[role]


def registration_from_pb(
    req: pb.RegisterRequest, role: state.NodeRole, job_secret: bytes | None = None
) -> state.Registration:
    """The registration as the state machine sees it: the credential's hash, not the
    credential (none when the request carries none, or something else than a credential).
    With a job secret the credential comes wrapped (`auth.wrap`); a wrong secret unwraps it
    into another value, whose hash the proof then does not cover."""
    credential = req.credential if len(req.credential) == auth.CREDENTIAL_BYTES else b""
    if credential and job_secret is not None:
        credential = auth.unwrap(job_secret, req.challenge, req.nonce, credential)
    return state.Registration(
        node_id=req.node_id,
        role=role,
        host=req.host,
        port=req.port,
        incarnation=req.incarnation,
        worker_num=req.worker_num,
        server_num=req.server_num,
        cluster_id=req.cluster_id,
        credential_digest=auth.credential_digest(credential) if credential else b"",
        nonce=req.nonce,
        proof=req.proof,
        spare=req.spare,
        challenge=req.challenge,
        job_id=req.job_id,
        call_seq=req.call_seq,
        collectives_generation=req.collectives_generation,
        collectives_answered=req.collectives_answered,
        protocol_revision=req.protocol_revision,
        cluster_version=req.cluster_version,
    )


def register_response(
    outcome: state.Accepted | state.Refused, heartbeat_interval_s: float, node_timeout_s: float
) -> pb.RegisterResponse:
    if isinstance(outcome, state.Refused):
        return pb.RegisterResponse(
            refused=pb.Refusal(
                reason=_REFUSAL_TO_PB[outcome.reason],
                message=outcome.message,
                retry_after_s=outcome.retry_after_s,
            )
        )
    return pb.RegisterResponse(
        accepted=pb.Accepted(
            cluster_id=outcome.cluster_id,
            registered=outcome.registered,
            expected=outcome.expected,
            rejoined=outcome.rejoined,
            generation=outcome.generation,
            heartbeat_interval_s=heartbeat_interval_s,
            node_timeout_s=node_timeout_s,
            spare=outcome.spare,
        )
    )


# A registration refused by a standby that knows no leader is tried again after this long.
NO_LEADER_RETRY_S = 0.5


def not_leader_response(message: str, leader: str) -> pb.RegisterResponse:
    """A standby's answer to a registration: go to `leader` ("" none leads right now)."""
    return pb.RegisterResponse(
        refused=pb.Refusal(
            reason=pb.REFUSAL_NOT_LEADER,
            message=message,
            retry_after_s=0.0 if leader else NO_LEADER_RETRY_S,
            leader=leader,
        )
    )


# The errors whose Exchange refusal says why by a reason (`failures.EXCHANGE_REFUSAL_KEY`).
_EXCHANGE_REFUSAL_TO_PB: dict[type[ClusterError], pb.ExchangeRefusalReason] = {
    CollectiveMismatchError: pb.EXCHANGE_REFUSAL_MISMATCH,
    PeerFinishedError: pb.EXCHANGE_REFUSAL_FINISHED,
}


def exchange_refusal(error: ClusterError) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that says why an Exchange was refused with `error`, beside its
    kind (`failures.status_of`): a serialized `ExchangeRefusal`; none without a reason."""
    reason = _EXCHANGE_REFUSAL_TO_PB.get(type(error))
    if reason is None:
        return ()
    return ((failures.EXCHANGE_REFUSAL_KEY, pb.ExchangeRefusal(reason=reason).SerializeToString()),)


def peer_table(peers: tuple[state.PeerInfo, ...]) -> pb.PeerTable:
    return pb.PeerTable(
        ranks=[p.rank for p in peers],
        node_ids=[p.node_id for p in peers],
        hosts=[p.host for p in peers],
        ports=[p.port for p in peers],
        roles=[_ROLE_TO_PB[p.role] for p in peers],
        local_ranks=[p.local_rank for p in peers],
        local_sizes=[p.local_size for p in peers],
    )


def whole_table(ready: pb.TopologyReady, table: pb.PeerTable) -> pb.TopologyReady:
    """`ready` with `table` in it: compressed into `peers_zlib` when it is larger than
    COMPRESS_TABLE_ABOVE (once per generation: every node gets this one message's bytes)."""
    if table.ByteSize() > COMPRESS_TABLE_ABOVE:
        ready.peers_zlib = zlib.compress(table.SerializeToString(), TABLE_ZLIB_LEVEL)
    else:
        ready.peers.CopyFrom(table)
    return ready


def topology_forms(event: pb.Event) -> tuple[bytes, tuple[bytes, bytes, bytes] | None]:
    """A topology event on the wire, and (when its whole table travels compressed) its form
    for a node that asked for tables by digest, the digest (SHA-256) and the compressed table
    (`cluster.scheduler.tables`)."""
    inline = event.SerializeToString()
    table = event.topology_ready.peers_zlib
    if not table:
        return inline, None
    digest = auth.sha256(table)
    referenced = pb.Event()
    referenced.CopyFrom(event)
    referenced.topology_ready.peers_zlib = b""
    referenced.topology_ready.peers_digest = digest
    return inline, (referenced.SerializeToString(), digest, table)


def event_to_pb(event: state.Event) -> pb.Event:
    if isinstance(event, state.ProgressEvent):
        return pb.Event(progress=pb.Progress(registered=event.registered, expected=event.expected))
    if isinstance(event, state.TopologyReadyEvent):
        ready = pb.TopologyReady(
            generation=event.generation, rollback_step=event.rollback_step, reason=event.reason
        )
        return pb.Event(topology_ready=whole_table(ready, peer_table(event.peers)))
    if isinstance(event, state.NodeFailedEvent):
        return pb.Event(
            node_failed=pb.NodeFailed(
                rank=event.rank,
                node_id=event.node_id,
                reason=event.reason,
                generation=event.generation,
            )
        )
    return pb.Event(shutdown=pb.Shutdown(ok=event.ok, reason=event.reason))


def memory_resume_of(message: pb.MemoryResume) -> MemoryResume:
    return MemoryResume(int(message.generation), int(message.step), message.why)


def memory_resume_to_pb(resumed: MemoryResume) -> pb.MemoryResume:
    return pb.MemoryResume(generation=resumed.generation, step=resumed.step, why=resumed.why)


def topology_delta_to_pb(
    event: state.TopologyReadyEvent, delta_from: int, rows: list[int]
) -> pb.Event:
    """`event` as the change from generation `delta_from`: only the peer table's `rows`."""
    return pb.Event(
        topology_ready=pb.TopologyReady(
            generation=event.generation,
            peers=peer_table(tuple(event.peers[row] for row in rows)),
            rollback_step=event.rollback_step,
            reason=event.reason,
            delta_from=delta_from,
            changed_rows=rows,
        )
    )


def status_to_pb(
    st: state.SchedulerState,
    now: float,
    told: state.Told | None = None,
    saving: Saving | None = None,
) -> pb.StatusResponse:
    """The job as the scheduler sees it; phase, generation and rollback step as `told` (the
    nodes were told them: with recovery, as on disk; None: as the state machine has them), and
    how `saving` goes."""
    nodes = st.in_status_order()
    told = told or state.Told(st.phase, st.generation, st.published_rollback_step)
    response = pb.StatusResponse(
        cluster_id=st.cluster_id,
        phase=PHASE_TO_PB[told.phase],
        generation=told.generation,
        worker_num=st.settings.worker_num,
        server_num=st.settings.server_num,
        uptime_s=now - st.started,
        recovery=st.recovery,
        detail=st.detail,
        rollback_step=told.rollback_step,
        nodes=[_node_status(st, m, now) for m in nodes],
    )
    if saving is not None:
        response.saving.CopyFrom(
            pb.StateSaving(
                error=saving.error,
                failing_for_s=saving.failing_for_s,
                failures=saving.failures,
                unsaved_changes=saving.unsaved_changes,
            )
        )
    return response


def _node_status(st: state.SchedulerState, m: state.Member, now: float) -> pb.NodeStatus:
    return pb.NodeStatus(
        node_id=m.node_id,
        role=role_to_pb(m.role),
        rank=m.rank,
        host=m.host,
        port=m.port,
        state=NODE_STATE_TO_PB[m.state],
        seconds_since_heartbeat=max(0.0, now - m.last_seen),
        incarnation=m.incarnation,
        restarts=m.restarts,
        connected=m.connected,
        checkpoints=m.checkpoints,
        spare=m.node_id in st.spares,
    )


def job_event_to_pb(event: JobEvent) -> pb.JobEvent:
    import json  # noqa: PLC0415 - only for those who follow the events (1.5 ms at import)

    return pb.JobEvent(
        seq=event.seq,
        time=event.time,
        event=event.kind,
        fields_json=json.dumps(dict(event.fields), separators=(",", ":")),
    )


def standing_to_pb(standing: Standing) -> pb.Leadership:
    return pb.Leadership(
        role=pb.SCHEDULER_ROLE_LEADER if standing.leading else pb.SCHEDULER_ROLE_STANDBY,
        leader=standing.leader,
        schedulers=standing.schedulers,
        lease_s=standing.lease_s,
        lease_left_s=standing.lease_left_s,
        state_store=standing.state_store,
    )
