"""The scheduler's state machine: who is in the job, with which rank, and what happens next.

Pure and synchronous: no I/O, no asyncio, no grpc, and time comes from an injected clock. Every
input (a registration, a stream opening or breaking, a heartbeat, a finish, the passing of time)
is a method call that returns what the outside world must be told: `Event`s to broadcast to every
watching node and `Evict`s that end one node's stream. The scheduler package turns those into
gRPC messages; the tests drive this class directly with a fake clock.

Trust: a registration carries the hash of the node's credential (and, when the job has a
secret, proof of it: `cluster.protocol.auth`); a member keeps that hash, and every later call of
the node is admitted by `admission.admit*` before any input method runs. A
registration of a live node's own incarnation must carry the same credential and address: it is
a retry, never an update.

Recovery: every change that a restarted scheduler must know (the topology formed, a node failed
or rejoined, a node finished, the job ended) bumps `revision`; `snapshot()` is then what must be
saved, before the change is told to anyone, and `SchedulerState.restore` rebuilds the job from
it. With `recovery` on, a node that dies after the job formed fails alone: the others are told
and wait; the same node id is taken back, with its rank, once it has been silent for the guard
(MS_NODE_TIMEOUT), and a new generation is published. A failed node that has not rejoined within
MS_TOPO_TIMEOUT after its guard ended fails the job, so that nothing waits forever.

Rollback: workers report the checkpoint steps they hold; every generation names the step on
disk all workers can roll back to, the newest that every worker holds (0 when one has none; the
workers may resume from a newer step held in memory: `rollback`). Taking "the minimum of each
rank's newest", as MindSpore does, can name a step some rank has already pruned; the newest
common step cannot. With checkpoints but none in common, the job fails saying what each holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import field, replace
from typing import Any

from cluster.protocol.backoff import guard_poll_s
from cluster.protocol.config import canonical_node_id
from cluster.protocol.errors import EvictedError, SnapshotError, UnknownNodeError
from cluster.protocol.records import (
    GUARD_POLL_MARGIN_S,
    Accepted,
    Effect,
    Event,
    Evict,
    Member,
    NodeFailedEvent,
    NodeRole,
    NodeState,
    PeerInfo,
    Phase,
    ProgressEvent,
    Refusal,
    Refused,
    Registration,
    ShutdownEvent,
    Told,
    TopologyReadyEvent,
)
from cluster.protocol.settings import JobSettings
from cluster.protocol.value import mutable
from cluster.scheduler.machine import ranks, snapshot, spares
from cluster.scheduler.machine.admission import Admission, Denial, Denied, ExchangeTicket
from cluster.scheduler.machine.finish_answers import FinishAnswers
from cluster.scheduler.machine.liveness import Liveness, silence_reason
from cluster.scheduler.machine.registrar import Registrar
from cluster.scheduler.machine.rollback import (
    NoCommonStep,
    RollbackPlanner,
    from_the_beginning,
    held_steps,
    rollback_step,
)
from cluster.scheduler.machine.spares import SparePool

__all__ = [
    "Accepted",
    "Admission",
    "Denial",
    "Denied",
    "Effect",
    "Event",
    "Evict",
    "ExchangeTicket",
    "Member",
    "NoCommonStep",
    "NodeFailedEvent",
    "NodeRole",
    "NodeState",
    "PeerInfo",
    "Phase",
    "ProgressEvent",
    "Refusal",
    "Refused",
    "Registration",
    "SchedulerState",
    "ShutdownEvent",
    "Told",
    "TopologyReadyEvent",
]


@mutable
class SchedulerState:
    """The job as the scheduler sees it. All methods are synchronous and free of I/O.

    Its parts, each a module of `cluster.scheduler.machine`: `admission` (who may join, which
    call is admitted), `registrar` (what a registration does to the job, `registrar`),
    `liveness` (silence and the guard), `pool` (the spares, `spares`) and `rollback` (the step
    every worker holds); ranks are placed by `ranks`.
    """

    cluster_id: str
    settings: JobSettings
    clock: Callable[[], float]
    phase: Phase = Phase.WAITING
    generation: int = 0
    detail: str = ""
    members: dict[str, Member] = field(default_factory=dict)
    # Spares (no rank; `spares`), and failed nodes whose rank a spare took, kept for their
    # guard.
    spares: dict[str, Member] = field(default_factory=dict)
    started: float = field(init=False)
    # Kept up to date with `members`, so that no input costs O(members): a 1024-node job
    # registers and finishes 1024 times.
    role_counts: dict[NodeRole, int] = field(init=False, repr=False, default_factory=dict)
    _finished: int = field(init=False, repr=False, default=0)
    # The topology as last published; every late watcher gets this same event.
    published: TopologyReadyEvent | None = field(init=False, repr=False, default=None)
    # Bumped by every change a restarted scheduler must know about (see the module docstring).
    revision: int = field(init=False, default=0)
    # The job this one replaced on the same recovery path (it had ended): its nodes' saved
    # files name it, and they are welcome in this job as new nodes.
    previous_cluster_id: str = ""
    # The etcd prefix where this scheduler found nothing saved and started this job ("": not
    # so): a node of another job it refuses is told first that this scheduler may have been
    # given the wrong prefix (`Admission`). Not saved: it is this process's finding.
    started_anew_under: str = field(init=False, default="")
    # Restored from a snapshot: alive members not yet back since the restart (one that fails or
    # finishes meanwhile is awaited no more: it holds no registration burst open).
    awaiting: set[str] = field(init=False, default_factory=set)
    # The generation the scheduler was restored in (0: never restored): collectives of that
    # generation may have been cut in two by the restart.
    restored_generation: int = field(init=False, default=0)
    # Nodes refused by the guard lately (node id -> when), until they hear that the job is
    # over: the scheduler waits a moment for them at the end (not saved, like the nonces).
    guard_waiting: dict[str, float] = field(init=False, repr=False, default_factory=dict)
    # Members whose Finish answer is on its way, or was lost with their stream: a finished job
    # waits a moment for those to ask again and hear it (`finish_answers`; not saved either).
    answers: FinishAnswers = field(init=False, repr=False, default_factory=FinishAnswers)
    admission: Admission = field(init=False, repr=False)
    registrar: Registrar = field(init=False, repr=False)
    liveness: Liveness = field(init=False, repr=False)
    pool: SparePool = field(init=False, repr=False)
    rollback: RollbackPlanner = field(init=False, repr=False, default_factory=RollbackPlanner)

    def __post_init__(self) -> None:
        self.started = self.clock()
        self.admission = Admission(self)
        self.registrar = Registrar(self)
        self.liveness = Liveness(self.settings)
        self.pool = SparePool(self)

    # -- queries -------------------------------------------------------------------------------

    @property
    def expected(self) -> int:
        return self.settings.expected

    @property
    def recovery(self) -> bool:
        return self.settings.recovery

    def peers(self) -> tuple[PeerInfo, ...]:
        """Ranked members: workers in rank order, then servers in rank order."""
        ranked = [m for m in self.members.values() if m.rank is not None]
        ranked.sort(key=lambda m: (m.role is NodeRole.SERVER, m.rank))
        return tuple(
            PeerInfo(m.rank, m.node_id, m.host, m.port, m.role, m.local_rank, m.local_size)
            for m in ranked
            if m.rank is not None
        )

    def in_status_order(self) -> list[Member]:
        """Every member and spare in the order Status shows them: workers by rank, then servers
        by rank (those without a rank first, by node id), then the spares by node id."""
        ranked = sorted(
            self.members.values(),
            key=lambda m: (m.role is NodeRole.SERVER, -1 if m.rank is None else m.rank, m.node_id),
        )
        return [*ranked, *sorted(self.spares.values(), key=lambda m: m.node_id)]

    @property
    def published_rollback_step(self) -> int:
        return 0 if self.published is None else self.published.rollback_step

    def find(self, node_id: str) -> Member | None:
        """The member or spare with this (canonical) node id."""
        return self.members.get(node_id) or self.spares.get(node_id)

    def collectives_report(self, reg: Registration) -> tuple[int, int, int] | None:
        """What an accepted registration says of the node's collectives that the rounds
        must weigh (`Rounds.answered_before`): (generation, rank, last answered), when that
        generation is the one this scheduler restored and still runs, and the node holds a
        rank in it. None otherwise; a first registration, the common case, returns at once."""
        generation, answered = reg.collectives_generation, reg.collectives_answered
        if not answered or not generation == self.restored_generation == self.generation:
            return None
        member = self.find(canonical_node_id(reg.node_id))
        if member is None or member.rank is None:
            return None
        return generation, member.rank, answered

    def member(self, node_id: str, incarnation: int) -> Member:
        member = self.find(canonical_node_id(node_id))
        if member is None or member.incarnation != incarnation:
            raise UnknownNodeError(
                f"node {node_id!r} (incarnation {incarnation}) is not a member of job "
                f"{self.cluster_id}: register first"
            )
        return member

    def catch_up(self) -> list[Event]:
        """What a node that has just opened its stream must hear to catch up.

        Nothing while the job forms: the node's Accepted carries the count, and the periodic
        progress broadcast follows. (One message per joining node is 1024 writes in a
        1024-node rendezvous, for no news.)
        """
        if self.phase is Phase.WAITING:
            return []
        if self.phase is Phase.READY and self.published is not None:
            return [self.published]
        return [ShutdownEvent(self.phase is Phase.FINISHED, self.detail)]

    def catch_up_for(self, node_id: str, told: list[Event]) -> list[Event]:
        """What of `told` a node whose stream just opened may hear (`ranks.catch_up_for`)."""
        return ranks.catch_up_for(self.find(node_id), self.generation, told)

    # -- inputs --------------------------------------------------------------------------------

    def register(self, reg: Registration) -> tuple[Accepted | Refused, list[Effect]]:
        """A node's Register call: its answer, and what it changes (`Registrar.register`)."""
        return self.registrar.register(reg)

    def connect(self, node_id: str, incarnation: int) -> list[Event]:
        """The node opened its Watch stream; returns what it must hear first. A node failed
        since its registration was accepted (its older stream ended while the answer waited
        for its save) is refused: its failure was told before this stream existed."""
        member = self.member(node_id, incarnation)
        if member.state is NodeState.FAILED:
            raise EvictedError(
                f"node {member.node_id!r} failed after its registration was accepted, before "
                "its stream opened: it registers again"
            )
        member.connected = True
        self.answers.told(member.node_id)  # back: this stream tells it the end
        self.liveness.seen(member, self.clock())
        self.awaiting.discard(member.node_id)
        return self.catch_up()

    def heartbeat(self, node_id: str, incarnation: int) -> None:
        member = self.member(node_id, incarnation)
        self.liveness.seen(member, self.clock())

    def report_checkpoints(
        self,
        node_id: str,
        incarnation: int,
        steps: Iterable[int],
        generation: int = 0,
        seq: int = 0,
    ) -> None:
        """The worker holds these checkpoint steps now (complete ones, after pruning), listed
        once it had put back the rollback step of `generation` (0: it did not say). `seq`: the
        report's number in its process (0: none); one older than a report already heard is
        ignored. Either change is saved: the step every worker keeps depends on both."""
        member = self.member(node_id, incarnation)
        put_back = self.rollback.put_back(member.node_id)
        if not self.rollback.report(
            member.node_id, incarnation, (generation, seq), self.generation
        ):
            return
        held = held_steps(steps)
        if held != member.checkpoints or self.rollback.put_back(member.node_id) != put_back:
            member.checkpoints = held
            self.revision += 1

    def _workers(self) -> list[Member]:
        return [m for m in self.members.values() if m.role is NodeRole.WORKER]

    def held_by_all(self) -> int:
        """A step every worker holds, for them to keep (0: none; `RollbackPlanner`)."""
        workers, now = self._workers(), self.clock()
        return self.rollback.held_by_all(
            self.generation, workers, now, self.published_rollback_step
        )

    def holdings(self) -> list[Member]:
        """The workers as a rollback step is planned from them (`RollbackPlanner.holdings`)."""
        return self.rollback.holdings(
            self.generation, self._workers(), self.published_rollback_step
        )

    def rollback_step(self) -> int | NoCommonStep:
        """The newest step every worker holds, as far as a new generation may roll back to it
        (`cluster.scheduler.machine.rollback`)."""
        return rollback_step(self.holdings())

    def reform(self, reason: str) -> list[Effect]:
        """Start a new generation with the same members: everyone rolls back (e.g. a collective
        was cut in two by a scheduler restart and cannot be completed)."""
        if self.phase is not Phase.READY:
            return []
        return self.publish(reason)

    def disconnect(self, node_id: str, incarnation: int, why: str = "") -> list[Effect]:
        """The node's stream broke: its process is gone (or its connection is); `why`: what
        its process said it dies of, when it said (`FinishRequest.failure`)."""
        try:
            member = self.member(node_id, incarnation)
        except UnknownNodeError:
            return []  # an old incarnation's stream closing late: nothing to do
        member.connected = False
        if member.state is NodeState.FINISHED:
            self.answers.closed(member.node_id, self.clock())
        if member.state is not NodeState.ALIVE or self.phase in (Phase.FINISHED, Phase.FAILED):
            return []
        if member.node_id in self.spares:
            return self.pool.died(
                member, self.clock(), why or "its connection to the scheduler broke"
            )
        # Alive until its connection broke: the guard counts from now, not from its last
        # heartbeat (which may be an interval older).
        self.liveness.seen(member, self.clock())
        return self.lose(
            member,
            why or "its connection to the scheduler broke (process exited, stopped or cut off?)",
        )

    def finish(self, node_id: str, incarnation: int) -> list[Effect]:
        member = self.member(node_id, incarnation)
        if member.node_id in self.spares:
            return self.pool.drop(member) if member.state is NodeState.ALIVE else []
        if self.phase is Phase.WAITING:
            # Leaving before the job formed: free the slot, nobody depends on it yet.
            self._forget(member)
            return [ProgressEvent(len(self.members), self.expected)]
        if member.state is NodeState.ALIVE:
            member.state = NodeState.FINISHED
            self.awaiting.discard(member.node_id)
            self._finished += 1
            self.revision += 1
        if member.state is NodeState.FINISHED:
            self.answers.counted(member.node_id)
        if self.phase is Phase.READY and self._finished == len(self.members):
            return self._end(ok=True, detail=f"all {len(self.members)} nodes finished")
        return []

    def finish_answered(self, node_id: str) -> None:
        """The answer to the node's Finish goes now (its saved count): lost with the node's
        stream, if that closed since the count (`finish_answers`)."""
        self.answers.answered(canonical_node_id(node_id))

    def told_end(self, node_id: str) -> None:
        """The job's end is handed to the node's stream."""
        self.answers.told(canonical_node_id(node_id))

    def owed_end(self) -> dict[str, float]:
        """The members a finished job still owes its end (their Finish counted, its answer lost
        with their stream), and how long more each is waited for: MS_NODE_TIMEOUT from when its
        stream closed (`finish_answers`). Nobody once every one heard it, or in any other
        phase."""
        if self.phase is not Phase.FINISHED:
            return {}
        return self.answers.owed(self.clock(), self.settings.node_timeout_s)

    def tick(self) -> list[Effect]:
        """Let time pass: heartbeat silence, the rejoin window and the topology timeout.

        Every effect found is returned, in order, also when a later member's silence ends the
        job in the same tick: the state changes behind them are applied (and saved), so they
        must be told. Nothing is looked at once the job is over.
        """
        now = self.clock()
        waited = now - self.started
        if self.phase is Phase.WAITING and waited > self.settings.topo_timeout_s:
            why = ranks.describe_missing(self.members.values(), self.settings, waited)
            return self._end(ok=False, detail=why)
        if not self.liveness.scan_due(now):
            return []
        effects: list[Effect] = []
        for member in list(self.members.values()):
            if self.phase in (Phase.FINISHED, Phase.FAILED):
                break
            effects.extend(self._tick_member(member, now))
            self.liveness.found(self.liveness.due(member))
        for member in list(self.spares.values()):
            effects.extend(self.pool.tick(member, now))
        return effects

    def _tick_member(self, member: Member, now: float) -> list[Effect]:
        silent = self.liveness.silence(member, now)
        if member.state is NodeState.ALIVE and silent > self.settings.silence_limit_s:
            if member.node_id in self.awaiting:
                why = f"it did not reconnect within {silent:.1f} s of the scheduler's restart"
            elif self.settings.heartbeat_enabled:
                why = silence_reason(silent)
            else:
                return []
            return self.lose(member, why)
        if (
            member.state is NodeState.FAILED
            and self.phase is Phase.READY
            and now - member.last_seen > self.settings.node_timeout_s + self.settings.topo_timeout_s
        ):
            return self._end(
                ok=False,
                detail=f"{member.describe()} failed ({member.failure}) and did not rejoin "
                f"within MS_TOPO_TIMEOUT={self.settings.topo_timeout_s:g} s after its guard ended",
            )
        return []

    def guard_window_s(self) -> float:
        """How long after a refusal by the guard its node asks again, at the latest
        (`backoff.guard_poll_s`: GUARD_POLL_S, longer in a job of more than 750 nodes), with
        GUARD_POLL_MARGIN_S to spare."""
        nodes = self.settings.worker_num + self.settings.server_num
        return guard_poll_s(nodes) + GUARD_POLL_MARGIN_S

    def awaited_after_end(self) -> bool:
        """Whether a node refused by the guard lately may still ask again and hear that the job
        is over (within `guard_window_s` of its refusal)."""
        window = self.guard_window_s()
        now = self.clock()
        return any(now - refused <= window for refused in self.guard_waiting.values())

    def discount_stall(self, seconds: float) -> None:
        """The scheduler itself did not run for `seconds` (its process was stopped, or starved
        of CPU): it could not hear anyone meanwhile, so nobody's silence during it counts. (The
        heartbeats that arrived meanwhile wait in its sockets, and may be read only after the
        next tick.)"""
        members = [*self.members.values(), *self.spares.values()]
        self.liveness.discount_stall(members, seconds, self.clock())

    def abort(self, reason: str) -> list[Effect]:
        """End the job as failed from outside (an operator, a signal)."""
        if self.phase in (Phase.FINISHED, Phase.FAILED):
            return []
        return self._end(ok=False, detail=reason)

    # -- persistence ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """What a restarted scheduler needs (`cluster.scheduler.machine.snapshot`)."""
        return snapshot.save(self)

    @classmethod
    def restore(
        cls,
        saved: dict[str, Any],
        settings: JobSettings,
        clock: Callable[[], float],
        *,
        new_cluster_id: str,
    ) -> SchedulerState:
        """The job saved in `snapshot`, every node given MS_NODE_TIMEOUT to reconnect (a saved
        job is a job with recovery, whatever `settings` say).

        A job that had ended is not resumed: a new job `new_cluster_id` starts, and the old
        job's nodes are welcome in it as new nodes. SnapshotError when it cannot be restored.
        """
        fresh = cls(
            cluster_id=new_cluster_id, settings=replace(settings, recovery=True), clock=clock
        )
        try:
            return snapshot.resume(fresh, saved)
        except (KeyError, TypeError, ValueError) as exc:
            raise SnapshotError(f"the saved state is malformed ({exc!r})") from None

    def add_restored(self, member: Member) -> None:
        """A member read back from a snapshot, counted as registration would have counted it."""
        self.members[member.node_id] = member
        self.role_counts[member.role] = self.role_counts.get(member.role, 0) + 1
        if member.state is NodeState.FINISHED:
            self._finished += 1
        elif member.state is NodeState.ALIVE:
            self.awaiting.add(member.node_id)

    # -- rules ---------------------------------------------------------------------------------

    def accepted(self, *, rejoined: bool, spare: bool = False) -> Accepted:
        return Accepted(
            cluster_id=self.cluster_id,
            registered=len(self.members),
            expected=self.expected,
            rejoined=rejoined,
            generation=self.generation,
            spare=spare,
        )

    def form_topology(self) -> list[Effect]:
        for role in NodeRole:
            ranks.assign_ranks(
                [m for m in self.members.values() if m.role is role], self.settings.space(role)
            )
        self.phase = Phase.READY
        return self.publish("formed")

    def publish(self, reason: str, promoted: str = "") -> list[Effect]:
        step = self.rollback_step()
        if isinstance(step, NoCommonStep):
            return self._end(ok=False, detail=step.message)
        if note := from_the_beginning(self.holdings()):
            reason = f"{reason}; {note}"
        self.generation += 1
        self.revision += 1
        self.published = TopologyReadyEvent(
            self.generation, self.peers(), step, reason, promoted=promoted
        )
        return [self.published]

    def lose(self, member: Member, why: str, *, promote: bool = True) -> list[Effect]:
        if self.phase is Phase.WAITING:
            # No rank yet, nobody depends on it: forget it so that a restart can take its place.
            self._forget(member)
            return [
                Evict(member.node_id, member.incarnation, why),
                ProgressEvent(len(self.members), self.expected),
            ]
        member.state = NodeState.FAILED
        member.failure = why
        self.awaiting.discard(member.node_id)
        self.revision += 1
        failed = NodeFailedEvent(member.rank, member.node_id, why, self.generation)
        if self.phase is Phase.READY and self.recovery:
            # The others wait for it to rejoin (or a spare takes its rank at once). Its stream,
            # if it is only cut off, is ended: a node must register again to come back, so
            # that its return is a new generation.
            evict = Evict(member.node_id, member.incarnation, why)
            spare = (
                spares.pick(self.spares.values(), member, self.members.values())
                if promote
                else None
            )
            return [failed, evict, *([] if spare is None else self.pool.promote(spare, member))]
        if self.phase is not Phase.READY:
            return [failed]
        return [failed, *self._end(ok=False, detail=f"{member.describe()} died: {why}")]

    def place_workers(self, newcomer: str) -> None:
        """The workers' local ranks once `newcomer` holds a rank with a new process: the others
        keep theirs (`ranks.place_locally`)."""
        workers = [m for m in self.members.values() if m.role is NodeRole.WORKER]
        ranks.assign_ranks(workers, self.settings.worker_num, newcomer=newcomer)

    def _forget(self, member: Member) -> None:
        del self.members[member.node_id]
        self.role_counts[member.role] -= 1
        self.forgotten(member.node_id)

    def forgotten(self, node_id: str) -> None:
        """`node_id` left the job for good (a node forgotten while the job forms, a spare gone):
        nothing is kept by its id, so that ids that come and go cost nothing."""
        self.admission.forget(node_id)
        self.rollback.forget(node_id)
        self.guard_waiting.pop(node_id, None)
        self.awaiting.discard(node_id)

    def _end(self, *, ok: bool, detail: str) -> list[Effect]:
        self.phase = Phase.FINISHED if ok else Phase.FAILED
        self.detail = detail
        self.revision += 1
        return [ShutdownEvent(ok, detail)]
