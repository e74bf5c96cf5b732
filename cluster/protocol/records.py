"""The records of the scheduler's state machine: phases, roles, registrations, events, members.

Plain data, no rules: the rules are in `cluster.scheduler.machine.state` (what happens) and
`cluster.scheduler.machine.admission` (who may ask).
"""

from __future__ import annotations

import enum
from dataclasses import field
from typing import Any

from cluster.protocol import auth
from cluster.protocol.value import frozen, mutable

# A node refused by the guard (a restarted worker, perhaps one that will be a spare) asks again
# at least this often, so that it hears at once that the job ended; once the job ends, the
# scheduler waits up to this long and a little more for those refused lately to ask again.
GUARD_POLL_S = 1.0
GUARD_POLL_MARGIN_S = 0.5


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
    # With a job secret: the registration answers a challenge this scheduler did not make, or
    # made too long ago (before a restart, another job's); the node gets a new one and retries.
    STALE_CHALLENGE = "stale_challenge"
    # The job finished well: a node still waiting to (re)join it, a spare or a restarted node
    # waiting out its guard, has nothing left to do and exits 0.
    JOB_FINISHED = "job_finished"
    # The node speaks another revision of the protocol (another release of cluster).
    VERSION_MISMATCH = "version_mismatch"

    @property
    def transient(self) -> bool:
        return self is Refusal.NODE_ALIVE


@frozen
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
    # CLUSTER_SPARE=1: a worker without a rank, waiting to take a failed worker's.
    spare: bool = False
    # With a job secret: the scheduler's challenge the proof answers, the job id it came with,
    # and the node's call number now (its calls from here on are numbered above it).
    challenge: bytes = b""
    job_id: str = ""
    call_seq: int = 0
    # Registering again: how far the node's collectives got, the last one answered (its number
    # in `collectives_generation`), so that a restarted scheduler knows what its predecessor
    # answered.
    collectives_generation: int = 0
    collectives_answered: int = 0
    # Which cluster the node runs (`cluster.protocol.version`): its protocol revision (0: it
    # says nothing, as nodes before revisions were sent) and its release ("" then).
    protocol_revision: int = 0
    cluster_version: str = ""

    def message(self) -> bytes:
        """What a job-secret proof covers: every field above but the proof and the node's
        version (a proof means the same in every release of one protocol revision)."""
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
                *(("spare",) if self.spare else ()),
                self.challenge,
                self.job_id,
                self.call_seq,
                self.collectives_generation,
                self.collectives_answered,
            )
        )


@frozen
class Accepted:
    cluster_id: str
    registered: int
    expected: int
    rejoined: bool
    generation: int
    # Accepted as a spare: no rank until the scheduler gives it a failed worker's.
    spare: bool = False


@frozen
class Refused:
    reason: Refusal
    message: str
    retry_after_s: float = 0.0
    # What the scheduler's own log says of it, where that is more than the caller may learn
    # (`cluster.protocol.version.refusal`); empty: `message`.
    logged: str = ""


@frozen
class PeerInfo:
    rank: int
    node_id: str
    host: str
    port: int
    role: NodeRole
    local_rank: int
    local_size: int


# Events broadcast to every watching node.
@frozen
class ProgressEvent:
    registered: int
    expected: int


@frozen
class TopologyReadyEvent:
    generation: int
    peers: tuple[PeerInfo, ...]
    rollback_step: int = 0
    reason: str = "formed"
    # The node id of a spare that took a failed worker's rank in this generation ("" if none).
    promoted: str = ""


@frozen
class NodeFailedEvent:
    rank: int | None  # None: the node held no rank (a spare)
    node_id: str
    reason: str
    generation: int


@frozen
class ShutdownEvent:
    ok: bool
    reason: str


Event = ProgressEvent | TopologyReadyEvent | NodeFailedEvent | ShutdownEvent


@frozen
class Told:
    """The job's phase, generation and rollback step as the nodes were told them (with
    recovery: as saved), which may lag the state machine's by a save."""

    phase: Phase
    generation: int
    rollback_step: int


@frozen
class Evict:
    """End this incarnation's stream: it is no longer a member and must register again."""

    node_id: str
    incarnation: int
    reason: str


Effect = Event | Evict


@mutable
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
    # A failed worker whose rank a spare took: that spare's node id ("" otherwise).
    replaced_by: str = ""
    # A spare that took a rank: the node id that held the rank before it ("" otherwise), and
    # the newest checkpoint step that node had reported then (-1: none, or not recorded).
    took_over: str = ""
    took_over_step: int = -1

    def describe(self) -> str:
        who = f"node {self.node_id!r} at {self.host}:{self.port}"
        return who if self.rank is None else f"rank {self.rank} ({who})"

    def saved(self) -> dict[str, Any]:
        """This member as the scheduler's snapshot holds it."""
        return {
            "node_id": self.node_id,
            "role": self.role.value,
            "host": self.host,
            "port": self.port,
            "incarnation": self.incarnation,
            "state": self.state.value,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "local_size": self.local_size,
            "restarts": self.restarts,
            "failure": self.failure,
            "checkpoints": list(self.checkpoints),
            # The hash only: the credential itself is never saved.
            "credential_sha256": self.credential_digest.hex(),
            "replaced_by": self.replaced_by,
            "took_over": self.took_over,
            "took_over_step": self.took_over_step,
        }

    @classmethod
    def loaded(cls, saved: dict[str, Any], now: float) -> Member:
        """A saved member, given the guard from `now`: a restarted scheduler cannot know what
        happened while it was down."""
        return cls(
            node_id=str(saved["node_id"]),
            role=NodeRole(saved["role"]),
            host=str(saved["host"]),
            port=int(saved["port"]),
            incarnation=int(saved["incarnation"]),
            last_seen=now,
            state=NodeState(saved["state"]),
            rank=None if saved["rank"] is None else int(saved["rank"]),
            local_rank=int(saved["local_rank"]),
            local_size=int(saved["local_size"]),
            restarts=int(saved["restarts"]),
            failure=str(saved.get("failure", "")),
            checkpoints=tuple(int(s) for s in saved.get("checkpoints", ())),
            credential_digest=bytes.fromhex(str(saved.get("credential_sha256", ""))),
            replaced_by=str(saved.get("replaced_by", "")),
            took_over=str(saved.get("took_over", "")),
            took_over_step=int(saved.get("took_over_step", -1)),
        )
