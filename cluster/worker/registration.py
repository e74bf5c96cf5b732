"""A worker's registration as it goes on the wire: its credential, and proof of the job secret.

Each attempt is a new request: with a job secret it carries a fresh nonce, the scheduler's
challenge and the HMAC of every field under the secret (`cluster.protocol.auth`), so that the
scheduler, which refuses a nonce it has seen and a challenge not its own or too old, takes it
once; the credential is the same in every attempt (wrapped under the secret, never in clear),
so that an attempt whose answer was lost is the same registration again.
"""

from __future__ import annotations

from cluster.protocol import auth
from cluster.protocol.config import ClusterConfig, Role
from cluster.protocol.records import NodeRole, Registration
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker.identity import NodeIdentity


def register_request(
    config: ClusterConfig,
    identity: NodeIdentity,
    cluster_id: str,
    job_secret: bytes | None,
    *,
    challenge: tuple[bytes, str] = (b"", ""),
    call_seq: int = 0,
) -> pb.RegisterRequest:
    """`challenge`: the scheduler's challenge and the job id it came with (a job secret's);
    `call_seq`: the node's last call number (its calls from here on go above it)."""
    role = NodeRole.SERVER if config.role is Role.SERVER else NodeRole.WORKER
    registration = Registration(
        node_id=identity.node_id,
        role=role,
        host=identity.host,
        port=identity.port,
        incarnation=identity.incarnation,
        worker_num=config.worker_num,
        server_num=config.server_num,
        cluster_id=cluster_id,
        credential_digest=auth.credential_digest(identity.credential),
        nonce=auth.new_nonce() if job_secret is not None else b"",
        spare=config.spare,
        challenge=challenge[0],
        job_id=challenge[1],
        call_seq=call_seq,
    )
    credential = identity.credential
    proof = b""
    if job_secret is not None:
        proof = auth.prove(job_secret, registration.message())
        credential = auth.wrap(job_secret, challenge[0], registration.nonce, credential)
    return pb.RegisterRequest(
        node_id=registration.node_id,
        role=pb.ROLE_SERVER if role is NodeRole.SERVER else pb.ROLE_WORKER,
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
        call_seq=call_seq,
    )
