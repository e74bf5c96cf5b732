"""Registration, a part of the scheduler's state machine: what a node's Register call does to
the job, once admission has let it through.

Pure, like `state`, which owns it (`SchedulerState.register`). Admission decides who may
register at all (`Admission.check_registration`, `check_new`: the protocol revision, the
credential, the job secret, the job named, the room left for the role); this part decides what
the registration becomes:
- a new node id joins: a member counted toward the job (the last one forms it), or a spare
  (`spares`);
- the same process again (the same incarnation) is a retry after a lost answer, or a
  reconnect: it proves itself with its credential, and its address cannot change;
- a new process of a known node id is refused until the old one has been silent for the guard
  (MS_NODE_TIMEOUT, `guard_waiting` notes who waits; beside a live old one, the refusal says the
  id is likely given to two processes, `_guard_message`); then, in a running job with recovery, it
  takes its rank back in a new generation (`_rejoin`), comes back a spare when its rank went to
  one, or takes the old process's place while the job forms.

Registrations accepted in a burst (while the job forms, or while a restored job's nodes come
back) hold the members' silence back (`Liveness.accepted`, `_in_burst`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from cluster.protocol import auth
from cluster.protocol.config import canonical_node_id, valid_node_id
from cluster.protocol.records import (
    Accepted,
    Effect,
    Evict,
    Member,
    NodeRole,
    NodeState,
    Phase,
    ProgressEvent,
    Refusal,
    Refused,
    Registration,
)
from cluster.protocol.settings import JobSettings
from cluster.protocol.value import mutable
from cluster.scheduler.machine import ranks, spares
from cluster.scheduler.machine.admission import Admission
from cluster.scheduler.machine.finish_answers import FinishAnswers
from cluster.scheduler.machine.liveness import Liveness
from cluster.scheduler.machine.spares import SparePool


class RegistrarHost(Protocol):
    """What registration reads and changes of the job (`SchedulerState`)."""

    cluster_id: str
    detail: str
    settings: JobSettings
    phase: Phase
    members: dict[str, Member]
    spares: dict[str, Member]
    role_counts: dict[NodeRole, int]
    started: float
    revision: int
    awaiting: set[str]
    guard_waiting: dict[str, float]
    answers: FinishAnswers
    admission: Admission
    liveness: Liveness
    pool: SparePool

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def expected(self) -> int: ...

    @property
    def recovery(self) -> bool: ...

    def find(self, node_id: str) -> Member | None: ...

    def accepted(self, *, rejoined: bool, spare: bool = False) -> Accepted: ...

    def form_topology(self) -> list[Effect]: ...

    def publish(self, reason: str, promoted: str = "") -> list[Effect]: ...

    def lose(self, member: Member, why: str, *, promote: bool = True) -> list[Effect]: ...


@mutable
class Registrar:
    """The Register calls of `SchedulerState`, a part it owns."""

    job: RegistrarHost

    def register(self, reg: Registration) -> tuple[Accepted | Refused, list[Effect]]:
        job = self.job
        if not valid_node_id(reg.node_id):
            return Refused(
                Refusal.INVALID_NODE,
                f"node id {reg.node_id[:140]!r} is not valid: use 1-128 characters of letters, "
                "digits and . _ : @ -, starting with a letter or digit",
            ), []
        node_id = canonical_node_id(reg.node_id)
        refusal = job.admission.check_registration(reg)
        if refusal is not None:
            if refusal.reason in (Refusal.JOB_OVER, Refusal.JOB_FINISHED):
                job.guard_waiting.pop(node_id, None)  # told
                return self._told_over(node_id, refusal), []
            return refusal, []
        now = job.clock()
        burst = self._in_burst(now)  # asked before: the registration that forms the job is one
        known = job.find(node_id)
        if known is not None and known.role is not reg.role:
            return Refused(
                Refusal.INVALID_NODE,
                f"node id {node_id!r} is already used by a {known.role.value}; node ids are "
                f"unique across roles, so give this {reg.role.value} another MS_NODE_ID "
                "(e.g. 'ps0' for a parameter server)",
            ), []
        again = known is not None and known.incarnation == reg.incarnation
        outcome = (
            self._register_new(node_id, reg, now)
            if known is None
            else self._register_known(known, reg, now)
        )
        if isinstance(outcome[0], Accepted):
            job.admission.registered(node_id, reg, again=again)
            job.guard_waiting.pop(node_id, None)  # its wait is over: a next one is told again
            if burst:
                job.liveness.accepted(now)
        return outcome

    def _told_over(self, node_id: str, refusal: Refused) -> Refused:
        """The refusal that tells `node_id` its job is over. A member whose Finish counted
        in a job that finished (its worker asks again, the answer lost with its connection)
        hears that it did, not to start a new scheduler."""
        job = self.job
        job.answers.told(node_id)
        member = job.members.get(node_id)
        if refusal.reason is not Refusal.JOB_FINISHED or member is None:
            return refusal
        if member.state is not NodeState.FINISHED:
            return refusal
        counted = f"job {job.cluster_id} finished ({job.detail}); this node's finish counted"
        return replace(refusal, message=counted)

    def _in_burst(self, now: float) -> bool:
        """Whether registrations come as a burst, ahead of heartbeats in gRPC's queue
        (`liveness`): while the job forms, and while a restored job's nodes come back (at most
        MS_TOPO_TIMEOUT, as a forming job waits). Any other registration is one node's."""
        job = self.job
        if job.phase is Phase.WAITING:
            return True
        return bool(job.awaiting) and now - job.started <= job.settings.topo_timeout_s

    def _register_new(
        self, node_id: str, reg: Registration, now: float
    ) -> tuple[Accepted | Refused, list[Effect]]:
        job = self.job
        if reg.spare:
            refusal = spares.check_new_spare(node_id, reg, job.spares, job.settings)
        else:
            refusal = job.admission.check_new(node_id, reg, job.role_counts.get(reg.role, 0))
        if refusal is not None:
            return refusal, []
        member = Member(
            node_id=node_id,
            role=reg.role,
            host=reg.host,
            port=reg.port,
            incarnation=reg.incarnation,
            last_seen=now,
            credential_digest=reg.credential_digest,
        )
        job.liveness.seen(member, now)
        if reg.spare:
            job.spares[node_id] = member
            job.revision += 1
            return job.accepted(rejoined=False, spare=True), job.pool.fill_down_rank()
        job.role_counts[reg.role] = job.role_counts.get(reg.role, 0) + 1
        job.members[node_id] = member
        effects: list[Effect] = [ProgressEvent(len(job.members), job.expected)]
        if len(job.members) == job.expected:
            effects.extend(job.form_topology())
        return job.accepted(rejoined=False), effects

    def _register_known(
        self, member: Member, reg: Registration, now: float
    ) -> tuple[Accepted | Refused, list[Effect]]:
        job = self.job
        if member.incarnation == reg.incarnation:
            return self._register_again(member, reg, now)
        if member.state is NodeState.FINISHED:
            return Refused(
                Refusal.JOB_OVER,
                f"{member.describe()} has already finished this job; a node id finishes once",
            ), []
        remaining = member.last_seen + job.settings.node_timeout_s - now
        if remaining > 0:
            job.guard_waiting[member.node_id] = now
            return Refused(
                Refusal.NODE_ALIVE,
                self._guard_message(member, reg, now, remaining),
                retry_after_s=remaining,
            ), []
        # Silent past the guard. A spare's id (or that of a node whose rank a spare took) comes
        # back a spare, also while the job forms; a running job takes any other back with its
        # rank, with recovery only.
        if member.node_id in job.spares or (job.recovery and job.phase is Phase.READY):
            back = job.pool.respare if member.node_id in job.spares else self._rejoin
            return back(member, reg, now)
        if job.phase is Phase.WAITING:  # still forming: the new process takes the old's place
            evict = Evict(member.node_id, member.incarnation, "replaced by a new process")
            member.incarnation = reg.incarnation
            member.credential_digest = reg.credential_digest
            member.host, member.port = reg.host, reg.port
            job.liveness.seen(member, now)
            member.restarts += 1
            return job.accepted(rejoined=False), [evict]
        return Refused(
            Refusal.JOB_OVER,
            f"{member.describe()} failed and recovery is off (MS_ENABLE_RECOVERY), so it cannot "
            "rejoin; restart the whole job",
        ), []

    def _guard_message(
        self, member: Member, reg: Registration, now: float, remaining: float
    ) -> str:
        """Why the guard refuses `reg`, a new process of `member`'s node id. While the id's
        holder is live right now (`Liveness.live_now`), the newcomer is most likely a second
        process given the same MS_NODE_ID, not a restart: its wait would be pushed back for as
        long as the holder lives, so the refusal names both processes and the likely mistake.
        Otherwise (the holder stopped, hung, or is not heard yet) it names when the holder was
        last heard and when the guard ends."""
        guard_s = self.job.settings.node_timeout_s
        if self.job.liveness.live_now(member, now):
            return (
                f"node id {member.node_id!r} is held by a live process (at {member.host}:"
                f"{member.port}, incarnation {member.incarnation}, heard "
                f"{now - member.last_seen:.1f} s ago), and this process (at {reg.host}:{reg.port}, "
                f"incarnation {reg.incarnation}) registers with it too: two processes of this job "
                "have the same MS_NODE_ID? give each its own; a restarted "
                f"{member.role.value} is taken once the old one has been silent for "
                f"MS_NODE_TIMEOUT={guard_s:g} s"
            )
        return (
            f"node id {member.node_id!r}{self._last_heard(member, now)}; the scheduler takes a "
            f"new process with that id only after MS_NODE_TIMEOUT={guard_s:g} s of silence, "
            f"against network jitter and identity takeover (retry in {remaining:.1f} s)"
        )

    def _last_heard(self, member: Member, now: float) -> str:
        """When the guard's `member` was last heard, as its refusal says it. A member restored
        from a snapshot and not heard since was given the guard from the restore: not a time
        it was seen alive (its process may have died with the previous scheduler)."""
        failed = " (failed)" if member.state is NodeState.FAILED else ""
        if member.node_id in self.job.liveness.unheard:  # the state began at the restore
            return (
                f"{failed} was not heard by this scheduler since it was restored "
                f"{now - self.job.started:.1f} s ago"
            )
        return f"{failed} was last seen alive {now - member.last_seen:.1f} s ago"

    def _register_again(
        self, member: Member, reg: Registration, now: float
    ) -> tuple[Accepted | Refused, list[Effect]]:
        """The same process again: a retry after a lost answer, or a reconnect. It proves it
        is the same with its credential, and its address cannot change (a process keeps the
        one it started with; a registration that would move a node is a forgery)."""
        job = self.job
        if not auth.same_digest(member.credential_digest, reg.credential_digest) or (
            member.host,
            member.port,
        ) != (reg.host, reg.port):
            return Refused(
                Refusal.UNAUTHENTICATED,
                f"{member.describe()} is registered with incarnation {member.incarnation}, and "
                "this registration of that incarnation has another credential or address: only "
                "the node's own process may register it again, from the same address",
            ), []
        if member.node_id in job.spares and not member.replaced_by:
            # A spare's own process back (its connection broke): a spare again.
            job.liveness.seen(member, now)
            member.state, member.failure = NodeState.ALIVE, ""
            job.revision += 1
            return job.accepted(rejoined=False, spare=True), job.pool.fill_down_rank()
        if member.node_id in job.spares:
            return Refused(
                Refusal.JOB_OVER,
                f"{member.describe()} was cut off, and its rank went to a spare meanwhile: this "
                "process cannot go on with it; start it again, and it joins as a spare once "
                f"MS_NODE_TIMEOUT={job.settings.node_timeout_s:g} s have passed",
            ), []
        job.liveness.seen(member, now)
        if member.state is NodeState.FAILED and job.recovery and job.phase is Phase.READY:
            # Back after it was declared failed (its connection broke, or it was cut off): no
            # other process can hold the id, so no guard; but the others have moved on
            # without it, so it comes back in a new generation.
            return self._rejoin(member, reg, now, restarted=False)
        return job.accepted(rejoined=False), []

    def _rejoin(
        self, member: Member, reg: Registration, now: float, *, restarted: bool = True
    ) -> tuple[Accepted, list[Effect]]:
        """A failed (or silent) node takes its rank back: a new generation."""
        job = self.job
        effects: list[Effect] = []
        if member.state is NodeState.ALIVE:  # silent past the guard, not yet noticed by tick()
            why = "a new process registered with its node id"
            effects.extend(job.lose(member, why, promote=False))
        if restarted:
            effects.append(Evict(member.node_id, member.incarnation, "replaced by a new process"))
            member.restarts += 1
        member.incarnation = reg.incarnation
        member.credential_digest = reg.credential_digest
        job.liveness.seen(member, now)
        member.state = NodeState.ALIVE
        member.failure = ""
        if (member.host, member.port) != (reg.host, reg.port):
            member.host, member.port = reg.host, reg.port
            # Perhaps on another host now: local ranks follow the hosts (ranks do not change).
            same_role = [m for m in job.members.values() if m.role is member.role]
            space = job.settings.space(member.role)
            ranks.assign_ranks(same_role, space, newcomer=member.node_id)
        job.awaiting.discard(member.node_id)
        effects.extend(job.publish(f"{member.describe()} rejoined"))
        return job.accepted(rejoined=True), effects
