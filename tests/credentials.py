"""Node credentials for tests that drive the state machine or the core directly: each
(node id, incarnation) has its own, as each real process draws its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cluster.protocol import auth, version
from cluster.protocol.config import canonical_node_id
from cluster.protocol.environment import job_secret_from_env, read_job_secret
from cluster.scheduler.machine.state import NodeRole, Registration
from cluster.transport import membership
from cluster.transport.membership import Caller
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc


def credential(node_id: str, incarnation: int) -> bytes:
    return auth.credential_digest(f"{canonical_node_id(node_id)}/{incarnation}".encode())[:32]


def digest(node_id: str, incarnation: int) -> bytes:
    """The hash the scheduler keeps of that process's credential."""
    return auth.credential_digest(credential(node_id, incarnation))


_call_numbers = iter(range(1, 1 << 62))


def presented(
    secret: bytes | None, node_id: str, incarnation: int, method: str = "KvGet"
) -> auth.Presented:
    """What a call of that process presents: its credential's hash, or with a job secret a
    fresh call proof over an empty request (as `membership.CallSigner` makes it)."""
    if secret is None:
        return auth.Presented(digest(node_id, incarnation))
    seq = next(_call_numbers)
    body = auth.body_digest(b"")
    key = auth.call_key(secret, digest(node_id, incarnation))
    mac = auth.call_mac(key, (method, canonical_node_id(node_id), incarnation, seq, body))
    return auth.Presented(call=auth.CallProof(method, seq, mac, body))


def caller(node_id: str, incarnation: int) -> Caller:
    """What the scheduler reads from a call of that process."""
    return Caller(node_id, incarnation, auth.Presented(digest(node_id, incarnation)))


def registration(node_id: str, incarnation: int = 1, cluster_id: str = "") -> Registration:
    """A worker of a 2-worker job at 127.0.0.1:6000, with its own credential."""
    return Registration(
        node_id,
        NodeRole.WORKER,
        "127.0.0.1",
        6000,
        incarnation,
        2,
        0,
        cluster_id,
        protocol_revision=version.PROTOCOL_REVISION,
        credential_digest=digest(node_id, incarnation),
    )


def read_metadata(channel: Any, secret: bytes | None, method: str = "Status") -> Any:
    """What an operator's read (Status, WatchEvents) of a job with `secret` carries, over a
    synchronous channel (as `cluster.tools.status.read_metadata` makes it)."""
    if secret is None:
        return ()
    answer = pb_grpc.SchedulerStub(channel).Challenge(pb.ChallengeRequest(), timeout=5)
    if not answer.challenge:
        return ()
    return membership.read_metadata(secret, answer.challenge, method)


def secret_of(env: Mapping[str, str]) -> bytes | None:
    """The job secret the environment `env` names."""
    source = job_secret_from_env(env)
    return None if source is None else read_job_secret(source)
