"""The scheduler's state machine: who is in the job, with which rank, and what happens next.

Pure and synchronous: no I/O, no asyncio, no grpc, and time comes from an injected clock. Every
input (a registration, a stream opening or breaking, a heartbeat, a finish, the passing of time)
is a method call that returns what the outside world must be told: `Event`s to broadcast to every
watching node and `Evict`s that end one node's stream. The scheduler package turns those into
gRPC messages; the tests drive this class directly with a fake clock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cluster.config import canonical_node_id, is_numeric_node_id, valid_node_id


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

    def describe(self) -> str:
        who = f"node {self.node_id!r} at {self.host}:{self.port}"
        return who if self.rank is None else f"rank {self.rank} ({who})"


class UnknownNodeError(Exception):
    """A stream or call named a node id / incarnation that is not a current member."""


@dataclass
class _Timing:
    started: float
    node_timeout_s: float
    topo_timeout_s: float
    heartbeat_enabled: bool


@dataclass
class SchedulerState:
    """The job as the scheduler sees it. All methods are synchronous and free of I/O."""

    cluster_id: str
    worker_num: int
    server_num: int
    node_timeout_s: float
    topo_timeout_s: float
    clock: Callable[[], float]
    heartbeat_enabled: bool = True
    recovery: bool = False
    phase: Phase = Phase.WAITING
    generation: int = 0
    detail: str = ""
    members: dict[str, Member] = field(default_factory=dict)
    started: float = field(init=False)
    # Kept up to date with `members`, so that no input costs O(members): a 1024-node job
    # registers and finishes 1024 times.
    _role_counts: dict[NodeRole, int] = field(init=False, repr=False, default_factory=dict)
    _finished: int = field(init=False, repr=False, default=0)
    # The topology as last published; every late watcher gets this same event.
    _published: TopologyReadyEvent | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self.started = self.clock()

    # -- queries -------------------------------------------------------------------------------

    @property
    def expected(self) -> int:
        return self.worker_num + self.server_num

    def peers(self) -> tuple[PeerInfo, ...]:
        """Ranked members: workers in rank order, then servers in rank order."""
        ranked = [m for m in self.members.values() if m.rank is not None]
        ranked.sort(key=lambda m: (m.role is NodeRole.SERVER, m.rank))
        return tuple(
            PeerInfo(m.rank, m.node_id, m.host, m.port, m.role, m.local_rank, m.local_size)
            for m in ranked
            if m.rank is not None
        )

    def member(self, node_id: str, incarnation: int) -> Member:
        member = self.members.get(canonical_node_id(node_id))
        if member is None or member.incarnation != incarnation:
            raise UnknownNodeError(
                f"node {node_id!r} (incarnation {incarnation}) is not a member of job "
                f"{self.cluster_id}: register first"
            )
        return member

    def welcome(self) -> list[Event]:
        """What a node that has just opened its stream must hear to catch up.

        Nothing while the job forms: the node's Accepted carries the count, and the periodic
        progress broadcast follows. (One message per joining node is 1024 writes in a
        1024-node rendezvous, for no news.)
        """
        if self.phase is Phase.WAITING:
            return []
        if self.phase is Phase.READY and self._published is not None:
            return [self._published]
        return [ShutdownEvent(self.phase is Phase.FINISHED, self.detail)]

    # -- inputs --------------------------------------------------------------------------------

    def register(self, reg: Registration) -> tuple[Accepted | Refused, list[Effect]]:
        if not valid_node_id(reg.node_id):
            return Refused(
                Refusal.INVALID_NODE,
                f"node id {reg.node_id[:140]!r} is not valid: use 1-128 characters of letters, "
                "digits and . _ : @ -, starting with a letter or digit",
            ), []
        node_id = canonical_node_id(reg.node_id)
        refusal = self._check_job(reg)
        if refusal is not None:
            return refusal, []
        now = self.clock()
        known = self.members.get(node_id)
        if known is not None and known.role is not reg.role:
            return Refused(
                Refusal.INVALID_NODE,
                f"node id {node_id!r} is already used by a {known.role.value}; node ids are "
                f"unique across roles, so give this {reg.role.value} another MS_NODE_ID "
                "(e.g. 'ps0' for a parameter server)",
            ), []
        if known is not None:
            return self._register_known(known, reg, now)
        refusal = self._check_new(node_id, reg)
        if refusal is not None:
            return refusal, []
        self._role_counts[reg.role] = self._role_counts.get(reg.role, 0) + 1
        self.members[node_id] = Member(
            node_id=node_id,
            role=reg.role,
            host=reg.host,
            port=reg.port,
            incarnation=reg.incarnation,
            last_seen=now,
        )
        effects: list[Effect] = [ProgressEvent(len(self.members), self.expected)]
        if len(self.members) == self.expected:
            effects.extend(self._form_topology())
        return self._accepted(rejoined=False), effects

    def connect(self, node_id: str, incarnation: int) -> list[Event]:
        """The node opened its Watch stream; returns what it must hear first."""
        member = self.member(node_id, incarnation)
        member.connected = True
        member.last_seen = self.clock()
        return self.welcome()

    def heartbeat(self, node_id: str, incarnation: int) -> None:
        member = self.member(node_id, incarnation)
        member.last_seen = self.clock()

    def disconnect(self, node_id: str, incarnation: int) -> list[Effect]:
        """The node's stream broke: its process is gone (or its connection is)."""
        try:
            member = self.member(node_id, incarnation)
        except UnknownNodeError:
            return []  # an old incarnation's stream closing late: nothing to do
        member.connected = False
        if member.state is not NodeState.ALIVE or self.phase in (Phase.FINISHED, Phase.FAILED):
            return []
        return self._lose(member, "its connection to the scheduler broke (process exited?)")

    def finish(self, node_id: str, incarnation: int) -> list[Effect]:
        member = self.member(node_id, incarnation)
        if self.phase is Phase.WAITING:
            # Leaving before the job formed: free the slot, nobody depends on it yet.
            self._forget(member)
            return [ProgressEvent(len(self.members), self.expected)]
        if member.state is NodeState.ALIVE:
            member.state = NodeState.FINISHED
            self._finished += 1
        if self.phase is Phase.READY and self._finished == len(self.members):
            return self._end(ok=True, detail=f"all {len(self.members)} nodes finished")
        return []

    def tick(self) -> list[Effect]:
        """Let time pass: heartbeat silence and the topology timeout."""
        now = self.clock()
        effects: list[Effect] = []
        if self.phase is Phase.WAITING and now - self.started > self.topo_timeout_s:
            return self._end(ok=False, detail=self._describe_missing(now))
        if self.heartbeat_enabled:
            for member in list(self.members.values()):
                silent = now - member.last_seen
                if member.state is NodeState.ALIVE and silent > self.node_timeout_s:
                    effects.extend(
                        self._lose(member, f"no heartbeat for {silent:.1f} s (hung or cut off?)")
                    )
        return effects

    def abort(self, reason: str) -> list[Effect]:
        """End the job as failed from outside (an operator, a signal)."""
        if self.phase in (Phase.FINISHED, Phase.FAILED):
            return []
        return self._end(ok=False, detail=reason)

    # -- rules ---------------------------------------------------------------------------------

    def _check_job(self, reg: Registration) -> Refused | None:
        if reg.cluster_id and reg.cluster_id != self.cluster_id:
            how = (
                ""
                if self.recovery
                else " (recovery is off, so a restarted scheduler starts a new job)"
            )
            return Refused(
                Refusal.FOREIGN_JOB,
                f"node {reg.node_id!r} belongs to job {reg.cluster_id}, but this scheduler runs "
                f"job {self.cluster_id}{how}: start the node again without its old state to join "
                "the new job",
            )
        if reg.worker_num != self.worker_num or reg.server_num != self.server_num:
            return Refused(
                Refusal.WORKER_NUM_MISMATCH,
                f"node {reg.node_id!r} has MS_WORKER_NUM={reg.worker_num}, "
                f"MS_SERVER_NUM={reg.server_num}, but the scheduler has "
                f"MS_WORKER_NUM={self.worker_num}, MS_SERVER_NUM={self.server_num}: start every "
                "process of the job with the same values",
            )
        if self.phase in (Phase.FINISHED, Phase.FAILED):
            return Refused(
                Refusal.JOB_OVER,
                f"job {self.cluster_id} is over ({self.phase.value}: {self.detail}); start a new "
                "scheduler for a new job",
            )
        return None

    def _check_new(self, node_id: str, reg: Registration) -> Refused | None:
        space = self.server_num if reg.role is NodeRole.SERVER else self.worker_num
        if reg.role is NodeRole.SERVER and self.server_num == 0:
            return Refused(
                Refusal.INVALID_NODE,
                f"node {node_id!r} is a parameter server, but the job has MS_SERVER_NUM=0",
            )
        if is_numeric_node_id(node_id) and int(node_id) >= space:
            return Refused(
                Refusal.INVALID_NODE,
                f"MS_NODE_ID={node_id} is numeric, so it is the rank, and must be below "
                f"the number of {reg.role.value}s ({space})",
            )
        same_role = self._role_counts.get(reg.role, 0)
        if self.phase is not Phase.WAITING or same_role >= space:
            return Refused(
                Refusal.CLUSTER_FULL,
                f"the job already has all {space} {reg.role.value}s (MS_WORKER_NUM="
                f"{self.worker_num}, MS_SERVER_NUM={self.server_num}); node {node_id!r} is one too "
                "many: check the numbers, or that no old process of the same job is still running",
            )
        return None

    def _register_known(
        self, member: Member, reg: Registration, now: float
    ) -> tuple[Accepted | Refused, list[Effect]]:
        if member.incarnation == reg.incarnation:
            # The same process again: a retry after a lost answer, or a reconnect. Its address
            # may change only while the job forms; after that, peers hold the published table.
            member.last_seen = now
            if self.phase is Phase.WAITING:
                member.host, member.port = reg.host, reg.port
            return self._accepted(rejoined=False), []
        if member.state is NodeState.FINISHED:
            return Refused(
                Refusal.JOB_OVER,
                f"{member.describe()} has already finished this job; a node id finishes once",
            ), []
        remaining = member.last_seen + self.node_timeout_s - now
        if remaining > 0:
            return Refused(
                Refusal.NODE_ALIVE,
                f"node id {member.node_id!r} was alive {now - member.last_seen:.1f} s ago; the "
                f"scheduler refuses a second process with that id until it has been silent for "
                f"MS_NODE_TIMEOUT={self.node_timeout_s:g} s (retry in {remaining:.1f} s)",
                retry_after_s=remaining,
            ), []
        # Silent past the guard. Rejoining a running job needs recovery (a later issue); while
        # the job is still forming, the new process simply takes the old one's place.
        if self.phase is Phase.WAITING:
            evict = Evict(member.node_id, member.incarnation, "replaced by a new process")
            member.incarnation = reg.incarnation
            member.host, member.port = reg.host, reg.port
            member.last_seen = now
            member.restarts += 1
            return self._accepted(rejoined=False), [evict]
        return Refused(
            Refusal.JOB_OVER,
            f"{member.describe()} failed and recovery is off (MS_ENABLE_RECOVERY), so it cannot "
            "rejoin; restart the whole job",
        ), []

    def _accepted(self, *, rejoined: bool) -> Accepted:
        return Accepted(
            cluster_id=self.cluster_id,
            registered=len(self.members),
            expected=self.expected,
            rejoined=rejoined,
            generation=self.generation,
        )

    def _form_topology(self) -> list[Effect]:
        for role, space in ((NodeRole.WORKER, self.worker_num), (NodeRole.SERVER, self.server_num)):
            _assign_ranks([m for m in self.members.values() if m.role is role], space)
        self.phase = Phase.READY
        self.generation += 1
        self._published = TopologyReadyEvent(self.generation, self.peers())
        return [self._published]

    def _lose(self, member: Member, why: str) -> list[Effect]:
        if self.phase is Phase.WAITING:
            # No rank yet, nobody depends on it: forget it so that a restart can take its place.
            self._forget(member)
            return [
                Evict(member.node_id, member.incarnation, why),
                ProgressEvent(len(self.members), self.expected),
            ]
        member.state = NodeState.FAILED
        rank = -1 if member.rank is None else member.rank
        failed = NodeFailedEvent(rank, member.node_id, why, self.generation)
        if self.phase is not Phase.READY:
            return [failed]
        return [failed, *self._end(ok=False, detail=f"{member.describe()} died: {why}")]

    def _forget(self, member: Member) -> None:
        del self.members[member.node_id]
        self._role_counts[member.role] -= 1

    def _end(self, *, ok: bool, detail: str) -> list[Effect]:
        self.phase = Phase.FINISHED if ok else Phase.FAILED
        self.detail = detail
        return [ShutdownEvent(ok, detail)]

    def _describe_missing(self, now: float) -> str:
        workers = [m for m in self.members.values() if m.role is NodeRole.WORKER]
        servers = [m for m in self.members.values() if m.role is NodeRole.SERVER]
        waited = now - self.started
        parts = [f"{len(workers)} of {self.worker_num} workers"]
        if self.server_num:
            parts.append(f"{len(servers)} of {self.server_num} servers")
        head = f"{' and '.join(parts)} registered after {waited:.0f} s (MS_TOPO_TIMEOUT)"
        missing = _missing_ranks(workers, self.worker_num)
        if missing == []:
            names = ", ".join(sorted(m.node_id for m in servers)) or "none"
            return f"{head}; registered servers: {names}"
        if missing is not None:
            return f"{head}; missing: rank{'s' if len(missing) > 1 else ''} {_ranges(missing)}"
        names = ", ".join(sorted(m.node_id for m in workers)) or "none"
        return f"{head}; registered node ids: {names}"


def _assign_ranks(members: list[Member], space: int) -> None:
    """Numeric node ids keep their number; the others fill the free ranks by (host, node id)."""
    taken = {int(m.node_id) for m in members if is_numeric_node_id(m.node_id)}
    free = iter(r for r in range(space) if r not in taken)
    for m in sorted(members, key=lambda m: (m.host, m.node_id)):
        if m.rank is None:
            m.rank = int(m.node_id) if is_numeric_node_id(m.node_id) else next(free)
    by_host: dict[str, list[Member]] = {}
    for m in sorted(members, key=lambda m: m.rank if m.rank is not None else -1):
        by_host.setdefault(m.host, []).append(m)
    for group in by_host.values():
        for local_rank, m in enumerate(group):
            m.local_rank, m.local_size = local_rank, len(group)


def _missing_ranks(workers: Iterable[Member], worker_num: int) -> list[int] | None:
    """The missing ranks, when every registered worker has a numeric id (so ranks are known)."""
    ids = [m.node_id for m in workers]
    if not all(is_numeric_node_id(i) for i in ids):
        return None
    held = {int(i) for i in ids}
    return [r for r in range(worker_num) if r not in held]


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(spans)
