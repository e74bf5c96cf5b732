"""The scheduler's messages as the worker core's events: protobuf in, plain data out; and a
worker's registration as it goes on the wire (`register_request`).

The worker's counterpart of `cluster.scheduler.convert`: the core never sees protobuf, so the
shell converts every answer and stream event here, and every failed call through the one table
of `cluster.transport.failures`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from cluster.protocol import auth, version
from cluster.protocol.config import ClusterConfig, Role, is_numeric_node_id
from cluster.protocol.errors import (
    ClusterError,
    CollectiveError,
    CollectiveMismatchError,
    NotLeaderError,
    PeerFinishedError,
)
from cluster.protocol.records import NodeRole, Registration
from cluster.protocol.topology import PeerColumns, Topology, find_row
from cluster.transport import failures
from cluster.transport.stub import WatchCall
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker.identity import NodeIdentity
from cluster.worker.machine import steps

# A standby scheduler's refusal (REFUSAL_NOT_LEADER): asked again after this long, at least.
NOT_LEADER_RETRY_S = 0.5


def answer(first: pb.Event) -> steps.Accepted | steps.Refused | steps.NotLeader:
    """The scheduler's answer to a registration (the first event of its stream)."""
    if first.HasField("accepted"):
        accepted = first.accepted
        return steps.Accepted(
            cluster_id=accepted.cluster_id,
            rejoined=accepted.rejoined,
            generation=accepted.generation,
            registered=accepted.registered,
            expected=accepted.expected,
            heartbeat_interval_s=accepted.heartbeat_interval_s,
            spare=accepted.spare,
        )
    refusal = first.refused
    if refusal.reason == pb.REFUSAL_NOT_LEADER:
        # A standby: the core follows the leader it names, or asks again (this or another
        # scheduler of the job) after at least NOT_LEADER_RETRY_S.
        return steps.NotLeader(
            refusal.leader, retry_after_s=max(refusal.retry_after_s, NOT_LEADER_RETRY_S)
        )
    return steps.Refused(
        refusal.message,
        transient=refusal.reason in (pb.REFUSAL_NODE_ALIVE, pb.REFUSAL_STALE_CHALLENGE),
        retry_after_s=refusal.retry_after_s,
        finished=refusal.reason == pb.REFUSAL_JOB_FINISHED,
        stale_challenge=refusal.reason == pb.REFUSAL_STALE_CHALLENGE,
        foreign=refusal.reason == pb.REFUSAL_FOREIGN_JOB,
    )


def rpc_failure(exc: grpc.aio.AioRpcError, where: str) -> steps.Event:
    """What a registration that ended with a status means: cut off (try again), a standby's
    pointer to its leader, or a refusal that ends this node's part."""
    failure = failures.failure_of(exc)
    if failure.kind is NotLeaderError:
        return steps.NotLeader(failure.leader, retry_after_s=NOT_LEADER_RETRY_S)
    if failure.kind is None or failure.timed_out:
        # Cut off, or not answered within the attempt's own deadline (the challenge's, on a
        # loaded scheduler): no refusal, tried again. The scheduler never refuses with it.
        relayed = failure.relay_cut_off and not failure.timed_out
        return steps.Unanswered(failure.details if relayed else "")
    if failure.relay_elsewhere:
        return steps.Fatal(failure.error("registering"))  # the relay's refusal, not the scheduler's
    return steps.Fatal(failure.kind(f"{where} rejected registration: {failure.details}"))


def lost(exc: grpc.aio.AioRpcError) -> steps.StreamLost | steps.NotLeader:
    """What an event stream that ended with a status means."""
    failure = failures.failure_of(exc)
    if failure.kind is NotLeaderError:
        return steps.NotLeader(failure.leader, retry_after_s=NOT_LEADER_RETRY_S)
    return steps.StreamLost(failure.details)


def stream_event(
    event: pb.Event,
    config: ClusterConfig,
    node_id: str,
    table: PeerColumns | None = None,
    *,
    host: str = "",
    last_rank: int | None = None,
) -> steps.Event | None:
    """An event of the stream as the core's event; None for the scheduler's heartbeat (its
    arrival is all it says). A topology without this node is `Unplaced`: a spare's.

    `table`: a topology's whole table as this node holds it (`peer_table.HeldTable`; default
    the event's own `peers`); `host` and `last_rank`, this node's address and rank, find its
    row in O(1) or O(log N) (`find_row`)."""
    kind = event.WhichOneof("kind")
    if kind == "progress":
        return steps.Progress(event.progress.registered, event.progress.expected)
    if kind == "topology_ready":
        ready = event.topology_ready
        columns: PeerColumns = ready.peers if table is None else table
        row = _row(columns, config, node_id, host, last_rank)
        if row is None:
            return steps.Unplaced(ready.generation)  # a spare, not promoted (yet)
        return steps.TopologyReady(_topology(ready, columns, config, row))
    if kind == "node_failed":
        failed = event.node_failed
        rank = failed.rank if failed.HasField("rank") else None
        return steps.NodeFailed(rank, failed.node_id, failed.reason, failed.generation)
    if kind == "shutdown":
        return steps.Shutdown(event.shutdown.ok, event.shutdown.reason)
    return None


def topology(ready: pb.TopologyReady, config: ClusterConfig, node_id: str) -> Topology:
    """This node's view; ClusterError when the topology does not name it."""
    row = _row(ready.peers, config, node_id, "", None)
    if row is None:
        raise ClusterError(
            f"the scheduler at {config.sched_address} sent a topology without this node"
        )
    return _topology(ready, ready.peers, config, row)


def _row(
    table: PeerColumns, config: ClusterConfig, node_id: str, host: str, rank: int | None
) -> int | None:
    """This node's row of the peer table; None: not in it. Workers come first in rank order,
    then servers: a numeric node id is its rank, a node keeps its rank for the life of the
    job, and ranks go by (host, node id), so the row is one of two guesses or found by
    bisection; only a table in another order is scanned (`find_row`)."""
    servers = config.role is Role.SERVER
    offset = config.worker_num if servers else 0
    guesses = [] if rank is None else [rank + offset]
    if is_numeric_node_id(node_id):
        guesses.append(int(node_id) + offset)
    size = len(table.node_ids)
    rows = range(config.worker_num, size) if servers else range(min(config.worker_num, size))
    return find_row(table, node_id, host, rows, guesses)


def _topology(
    ready: pb.TopologyReady, table: PeerColumns, config: ClusterConfig, me: int
) -> Topology:
    """The view of the node in row `me`: the columns stay as they arrived."""
    return Topology(
        generation=ready.generation,
        rank=table.ranks[me],
        local_rank=table.local_ranks[me],
        local_size=table.local_sizes[me],
        size=config.worker_num,  # the scheduler refuses a node with another count
        table=table,
        rollback_step=ready.rollback_step,
        reason=ready.reason,
    )


# -- a registration on the wire ----------------------------------------------------------------
# Each attempt is a new request: with a job secret it carries a fresh nonce, the scheduler's
# challenge and the HMAC of every field under the secret (`cluster.protocol.auth`), so that the
# scheduler, which refuses a nonce it has seen and a challenge not its own or too old, takes it
# once; the credential is the same in every attempt (wrapped under the secret, never in clear),
# so that an attempt whose answer was lost is the same registration again.


def register_request(
    config: ClusterConfig,
    identity: NodeIdentity,
    cluster_id: str,
    job_secret: bytes | None,
    *,
    challenge: tuple[bytes, str] = (b"", ""),
    call_seq: int = 0,
    collectives: tuple[int, int] = (0, 0),
) -> pb.RegisterRequest:
    """`challenge`: the scheduler's challenge and the job id it came with (a job secret's);
    `call_seq`: the node's last call number (its calls from here on go above it);
    `collectives`: the generation and number of its last collective answered."""
    role = NodeRole.SERVER if config.role is Role.SERVER else NodeRole.WORKER
    credential = identity.credential
    registration = Registration(
        node_id=identity.node_id,
        role=role,
        host=identity.host,
        port=identity.port,
        incarnation=identity.incarnation,
        worker_num=config.worker_num,
        server_num=config.server_num,
        cluster_id=cluster_id,
        # Only a proof covers it: the scheduler hashes the credential it receives itself.
        credential_digest=b"" if job_secret is None else auth.credential_digest(credential),
        nonce=auth.new_nonce() if job_secret is not None else b"",
        spare=config.spare,
        challenge=challenge[0],
        job_id=challenge[1],
        call_seq=call_seq,
        collectives_generation=collectives[0],
        collectives_answered=collectives[1],
        protocol_revision=version.PROTOCOL_REVISION,
        cluster_version=version.VERSION,
    )
    proof = b""
    if job_secret is not None:
        proof = auth.prove(job_secret, registration.message())
        credential = auth.wrap(job_secret, challenge[0], registration.nonce, credential)
    return _on_the_wire(registration, credential, proof)


def _on_the_wire(registration: Registration, credential: bytes, proof: bytes) -> pb.RegisterRequest:
    """`registration` as the worker sends it, with its `credential` (wrapped under a job secret)
    and `proof` (of the secret) in place of the credential's digest."""
    return pb.RegisterRequest(
        node_id=registration.node_id,
        role=pb.ROLE_SERVER if registration.role is NodeRole.SERVER else pb.ROLE_WORKER,
        host=registration.host,
        port=registration.port,
        incarnation=registration.incarnation,
        worker_num=registration.worker_num,
        server_num=registration.server_num,
        cluster_id=registration.cluster_id,
        credential=credential,
        nonce=registration.nonce,
        proof=proof,
        spare=registration.spare,
        challenge=registration.challenge,
        job_id=registration.job_id,
        call_seq=registration.call_seq,
        collectives_generation=registration.collectives_generation,
        collectives_answered=registration.collectives_answered,
        protocol_revision=registration.protocol_revision,
        cluster_version=registration.cluster_version,
    )


_EXCHANGE_OPS = {
    "barrier": pb.EXCHANGE_BARRIER,
    "allgather": pb.EXCHANGE_ALLGATHER,
    "broadcast": pb.EXCHANGE_BROADCAST,
}


def exchange_request(
    node_id: str, generation: int, seq: int, op: str, root: int, value: bytes, withdrawn: str = ""
) -> pb.ExchangeRequest:
    """Collective #`seq` of `generation`; `op` is "barrier", "allgather" or "broadcast";
    `withdrawn`: why this rank withdraws from it (no `value` then)."""
    return pb.ExchangeRequest(
        node_id=node_id,
        generation=generation,
        seq=seq,
        op=_EXCHANGE_OPS[op],
        root=root,
        value=value,
        withdrawn=withdrawn,
    )


# The error each reason of an Exchange's refusal raises (`pb.ExchangeRefusal`).
_EXCHANGE_REFUSALS: dict[int, type[CollectiveError]] = {
    pb.EXCHANGE_REFUSAL_MISMATCH: CollectiveMismatchError,
    pb.EXCHANGE_REFUSAL_FINISHED: PeerFinishedError,
}


def exchange_failure(
    exc: grpc.aio.AioRpcError, failure: failures.CallFailure
) -> failures.CallFailure:
    """What a failed Exchange means, with the reason of the scheduler's refusal where it gives
    one (`failures.EXCHANGE_REFUSAL_KEY`): a collective that another rank called as another
    one is a CollectiveMismatchError, one refused as a rank has finished a PeerFinishedError.
    A CollectiveError without a reason (an older
    scheduler's), or with one this worker does not know, stays a CollectiveError."""
    if failure.kind is not CollectiveError:
        return failure
    pairs: Any = exc.trailing_metadata() or ()  # (key, value) pairs; the stubs disagree
    sent = dict(pairs).get(failures.EXCHANGE_REFUSAL_KEY)
    try:
        reason = pb.ExchangeRefusal.FromString(sent if isinstance(sent, bytes) else b"").reason
    except DecodeError:  # not a refusal's reason: none
        reason = pb.EXCHANGE_REFUSAL_UNSPECIFIED
    kind = _EXCHANGE_REFUSALS.get(reason)
    return failure if kind is None else dataclasses.replace(failure, kind=kind)


# A generation resumed from memory, as rank 0 reports it: (generation, step, why).
Resumed = tuple[int, int, str]


def checkpoints_request(
    identity: NodeIdentity, steps: list[int], generation: int, seq: int, resumed: Resumed | None
) -> pb.ReportCheckpointsRequest:
    """A report of the steps this node holds (report number `seq`), for `generation`."""
    request = pb.ReportCheckpointsRequest(
        node_id=identity.node_id,
        incarnation=identity.incarnation,
        steps=steps,
        generation=generation,
        report_seq=seq,
    )
    if resumed is not None:
        generation, step, why = resumed
        request.resumed.CopyFrom(pb.MemoryResume(generation=generation, step=step, why=why))
    return request


def kv_set_request(key: str, value: bytes) -> pb.KvSetRequest:
    return pb.KvSetRequest(key=key, value=value)


def kv_get_request(keys: list[str]) -> pb.KvGetRequest:
    return pb.KvGetRequest(keys=keys)


def kv_wait_request(keys: list[str], timeout_s: float) -> pb.KvWaitRequest:
    return pb.KvWaitRequest(keys=keys, timeout_s=timeout_s)


def kv_add_request(key: str, amount: int, add_id: int) -> pb.KvAddRequest:
    """A counter's add, numbered: the scheduler counts a retry of it (the same `add_id`) once."""
    return pb.KvAddRequest(key=key, amount=amount, add_id=add_id)


async def first_answer(call: WatchCall, where: str) -> pb.Event:
    """The first event of a registration's stream: its answer, accepted or refused."""
    first = await call.read()
    if first is grpc.aio.EOF:  # type: ignore[attr-defined]  # missing from grpc-stubs
        raise asyncio.InvalidStateError("the scheduler closed the stream without an answer")
    assert isinstance(first, pb.Event)
    if first.WhichOneof("kind") not in ("accepted", "refused"):
        raise ClusterError(f"{where} answered registration with {first}")
    return first


def finish_request(identity: NodeIdentity, failure: str = "") -> pb.FinishRequest:
    """This node is done; with `failure`, the first line of the error its process dies of."""
    return pb.FinishRequest(
        node_id=identity.node_id, incarnation=identity.incarnation, failure=failure
    )
