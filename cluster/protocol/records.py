"""The records of the scheduler's state machine: phases, roles, registrations, events, members.

Plain data, no rules: the rules are in `cluster.protocol.state` (what happens) and
`cluster.protocol.admission` (who may ask).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cluster.protocol import auth


class Phase(enum.Enum):
    WAITING = "waiting"  # for nodes to register
    READY = "ready"  # every node is in and has its rank
    FINISHED = "finished"  # every node called Finish
    FAILED = "failed"  # a node died, or the topology timed out


class NodeRole(enum.Enum):
    WORKER = "worker"
    SERVER = "server"


class NodeState(enum.Enum):
    ALIVE = "alive"
    FAILED = "failed"
    FINISHED = "finished"


class Refusal(enum.Enum):
    CLUSTER_FULL = "cluster_full"
    WORKER_NUM_MISMATCH = "worker_num_mismatch"
    FOREIGN_JOB = "foreign_job"
    INVALID_NODE = "invalid_node"
    JOB_OVER = "job_over"
    # The job has a secret and the registration did not prove it (or was a replay).
    NOT_A_MEMBER = "not_a_member"
    # A registration of a live node's own incarnation with another credential or address.
    UNAUTHENTICATED = "unauthenticated"
    NODE_ALIVE = "node_alive"  # transient: the guard

    @property
    def transient(self) -> bool:
        return self is Refusal.NODE_ALIVE


@dataclass(frozen=True)
class Registration:
    node_id: str
    role: NodeRole
    host: str
    port: int
    incarnation: int
    worker_num: int
    server_num: int
    cluster_id: str = ""
    # SHA-256 of the node's credential (the credential itself never reaches the state).
    credential_digest: bytes = field(default=b"", repr=False)
    # With a job secret: a fresh nonce and the HMAC of `message()` under the secret.
    nonce: bytes = b""
    proof: bytes = field(default=b"", repr=False)

    def message(self) -> bytes:
        """What a job-secret proof covers: every field above but the proof."""
        return auth.canonical(
            (
                self.node_id,
                self.role.value,
                self.host,
                self.port,
                self.incarnation,
                self.worker_num,
                self.server_num,
                self.cluster_id,
                self.credential_digest,
                self.nonce,
            )
        )


@dataclass(frozen=True)
class Accepted:
    cluster_id: str
    registered: int
    expected: int
    rejoined: bool
    generation: int


@dataclass(frozen=True)
class Refused:
    reason: Refusal
    message: str
    retry_after_s: float = 0.0


@dataclass(frozen=True)
class PeerInfo:
    rank: int
    node_id: str
    host: str
    port: int
    role: NodeRole
    local_rank: int
    local_size: int


# Events broadcast to every watching node.
@dataclass(frozen=True)
class ProgressEvent:
    registered: int
    expected: int


@dataclass(frozen=True)
class TopologyReadyEvent:
    generation: int
    peers: tuple[PeerInfo, ...]
    rollback_step: int = 0
    reason: str = "formed"


@dataclass(frozen=True)
class NodeFailedEvent:
    rank: int
    node_id: str
    reason: str
    generation: int


@dataclass(frozen=True)
class ShutdownEvent:
    ok: bool
    reason: str


Event = ProgressEvent | TopologyReadyEvent | NodeFailedEvent | ShutdownEvent


@dataclass(frozen=True)
class Evict:
    """End this incarnation's stream: it is no longer a member and must register again."""

    node_id: str
    incarnation: int
    reason: str


Effect = Event | Evict


@dataclass
class Member:
    node_id: str
    role: NodeRole
    host: str
    port: int
    incarnation: int
    last_seen: float
    state: NodeState = NodeState.ALIVE
    rank: int | None = None
    local_rank: int = 0
    local_size: int = 1
    connected: bool = False
    restarts: int = 0
    failure: str = ""  # why it failed, while it is FAILED
    checkpoints: tuple[int, ...] = ()  # the steps it last reported holding
    # SHA-256 of the credential of this incarnation: every call of the node must match it.
    credential_digest: bytes = field(default=b"", repr=False)

    def describe(self) -> str:
        who = f"node {self.node_id!r} at {self.host}:{self.port}"
        return who if self.rank is None else f"rank {self.rank} ({who})"
