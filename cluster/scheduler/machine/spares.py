"""Hot spares: the state machine's decisions about workers that hold no rank.

Pure, like `state`, which uses it. A spare is a member of the job without a
rank: admitted like any node (node credential, job secret), heartbeating, not counted in
MS_WORKER_NUM, and capped (CLUSTER_MAX_SPARES) so that registrations cannot exhaust the
scheduler. The scheduler keeps them apart from the ranked members, in `SchedulerState.spares`,
with the records of failed ranked nodes whose rank a spare took: such a node id stays refused
for the guard (MS_NODE_TIMEOUT, the seeds' rule), and when it comes back it is a spare too.

The rules:
- A ranked worker that fails with recovery on hands its rank to a live spare at once (the
  spare on the failed node's host first, so that it can read the rank's checkpoint files, then
  by node id); the spare inherits the failed node's reported checkpoints, since it holds that
  rank's files from now on, and the job goes on in a new generation. Its local rank is the
  lowest free on its own host; the workers that go on keep theirs (`ranks.place_locally`).
- A spare that registers while a worker's rank is down takes that rank at once.
- A parameter server's rank never goes to a spare (spares are workers): the job waits for the
  server's node to rejoin, as it does without spares.
- A spare that dies is just gone: nobody waits for it; its record keeps its id refused for the
  guard, like any node's, and is then dropped. A spare that finishes is gone at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from cluster.protocol.records import (
    Accepted,
    Effect,
    Evict,
    Member,
    NodeRole,
    NodeState,
    Phase,
    Refusal,
    Refused,
    Registration,
)
from cluster.protocol.settings import JobSettings
from cluster.protocol.value import mutable
from cluster.scheduler.machine.liveness import Liveness
from cluster.scheduler.machine.rollback import RollbackPlanner


def check_new_spare(
    node_id: str, reg: Registration, spares: Mapping[str, Member], settings: JobSettings
) -> Refused | None:
    """Whether a new node id may register as a spare (None: it may)."""
    if reg.role is not NodeRole.WORKER:
        return Refused(
            Refusal.INVALID_NODE,
            f"node {node_id!r} registers as a spare, but only workers can be spares "
            "(unset CLUSTER_SPARE for parameter servers)",
        )
    if not settings.recovery:
        return Refused(
            Refusal.INVALID_NODE,
            f"node {node_id!r} registers as a spare, but this job runs without recovery "
            "(MS_ENABLE_RECOVERY), so no rank is ever handed over: start the job with recovery",
        )
    cap = settings.limits.max_spares
    if len(spares) >= cap:
        return Refused(
            Refusal.CLUSTER_FULL,
            f"the job already holds {len(spares)} spares and failed nodes waiting out their "
            f"guard, the most it takes (CLUSTER_MAX_SPARES={cap}); node {node_id!r} is one too "
            "many: start fewer spares, or raise CLUSTER_MAX_SPARES on the scheduler",
        )
    return None


def live(spares: Iterable[Member]) -> list[Member]:
    """The spares that can take a rank now."""
    return [m for m in spares if m.state is NodeState.ALIVE and m.rank is None]


def others_finished(members: Iterable[Member], failed: Member) -> bool:
    """Whether `failed`'s rank has a state that only its node holds now: it reported
    checkpoints, and every other worker of the job has finished (called cluster.finalize()),
    past the end, their state servers stopped. A spare given the rank could fetch its state
    from nobody, while `failed`'s own node, restarted, finds it in its files: the rank waits
    for that node, or for the node that held it before `failed` took it (`Member.took_over`),
    back as a spare, where its files hold the rank's newest step (`gives_back`). A rank that
    reported none (its ranks work alone, or keep their state elsewhere) goes to a spare as
    ever."""
    if not failed.checkpoints:
        return False
    others = [m for m in members if m.role is NodeRole.WORKER and m is not failed]
    return bool(others) and all(m.state is NodeState.FINISHED for m in others)


def newest_step(member: Member) -> int:
    """The newest checkpoint step reported for `member`'s rank (-1: none)."""
    return max(member.checkpoints, default=-1)


def gives_back(failed: Member) -> bool:
    """Whether the node that held `failed`'s rank before `failed` took it (`Member.took_over`)
    may take it back once every other worker has finished: only where its files hold the
    rank's newest step, that is, where the rank reported no step newer than the newest that
    node had reported when it lost the rank (`Member.took_over_step`). Where it did (`failed`
    trained on, writing checkpoints on its own disk), that node could resume the rank from
    an older step only, with no peer left to give it the newer one: the rank waits for
    `failed`'s own node."""
    return bool(failed.took_over) and newest_step(failed) <= failed.took_over_step


def pick(spares: Iterable[Member], failed: Member, members: Iterable[Member]) -> Member | None:
    """The spare to take `failed`'s rank: one on its host first, then by node id. None for a
    parameter server's (spares are workers, and a server's rank waits for its node); once
    every other worker has finished, only the rank's previous holder, where its files hold the
    rank's newest step (`others_finished`, `gives_back`)."""
    candidates = live(spares) if failed.role is NodeRole.WORKER else []
    if others_finished(members, failed):
        back = failed.took_over if gives_back(failed) else None
        candidates = [m for m in candidates if m.node_id == back]
    if not candidates:
        return None
    return min(candidates, key=lambda m: (m.host != failed.host, m.node_id))


def hand_over(failed: Member, spare: Member) -> None:
    """`spare` takes `failed`'s rank and the checkpoints reported for it, not its local rank
    (the spare's host may be another: `SpareHost.place_workers` places it), and remembers whose
    rank it took and the newest step reported for it then; `failed` keeps its record,
    rankless, for the guard."""
    spare.rank, failed.rank = failed.rank, None
    spare.took_over, failed.took_over = failed.node_id, ""
    spare.took_over_step, failed.took_over_step = newest_step(failed), -1
    spare.checkpoints, failed.checkpoints = failed.checkpoints, ()
    failed.local_rank, failed.local_size = 0, 1
    failed.replaced_by = spare.node_id


def expiry(member: Member, settings: JobSettings) -> float:
    """When a failed record among the spares is dropped: a dead spare's after its guard, a
    replaced worker's after its guard and MS_TOPO_TIMEOUT (its restart comes back as a spare
    within that window, as a failed worker's does with its rank)."""
    window = settings.node_timeout_s + (settings.topo_timeout_s if member.replaced_by else 0.0)
    return member.last_seen + window


class SpareHost(Protocol):
    """What the spare pool reads and changes of the job (`SchedulerState`)."""

    settings: JobSettings
    phase: Phase
    members: dict[str, Member]
    spares: dict[str, Member]
    revision: int
    liveness: Liveness
    rollback: RollbackPlanner

    def publish(self, reason: str, promoted: str = "") -> list[Effect]: ...

    def accepted(self, *, rejoined: bool, spare: bool = False) -> Accepted: ...

    def place_workers(self, newcomer: str) -> None: ...

    def forgotten(self, node_id: str) -> None: ...


@mutable
class SparePool:
    """The spares' inputs of `SchedulerState`, a part it owns."""

    job: SpareHost
    promotions: int = 0  # ranks handed to a spare so far

    def tick(self, member: Member, now: float) -> list[Effect]:
        """Time passes for a spare, or a failed record among them; the next scan includes it.
        Without heartbeats (MS_DISABLE_HEARTBEAT) a spare's silence says nothing: only its
        broken stream tells that it died (`died`), as for a ranked node."""
        job, liveness = self.job, self.job.liveness
        silent = liveness.silence(member, now) if job.settings.heartbeat_enabled else 0.0
        if member.state is NodeState.ALIVE and silent > job.settings.silence_limit_s:
            self.died(member, member.last_seen, f"no heartbeat for {silent:.1f} s")
        elif member.state is NodeState.FAILED and now > expiry(member, job.settings):
            return self.drop(member)
        alive = member.state is NodeState.ALIVE
        liveness.found(liveness.due(member) if alive else expiry(member, job.settings))
        return []

    def promote(self, spare: Member, failed: Member) -> list[Effect]:
        """`spare` takes the rank of `failed` (a ranked worker that failed): a new generation;
        `failed` waits out its guard among the spares."""
        job = self.job
        hand_over(failed, spare)
        job.rollback.handed_over(failed.node_id, spare.node_id)
        del job.members[failed.node_id], job.spares[spare.node_id]
        job.members[spare.node_id], job.spares[failed.node_id] = spare, failed
        job.place_workers(spare.node_id)
        self.promotions += 1
        reason = f"spare {spare.node_id!r} took rank {spare.rank} of node {failed.node_id!r}"
        return job.publish(reason, promoted=spare.node_id)

    def fill_down_rank(self) -> list[Effect]:
        """A spare came (back) while a rank is down: it takes that rank at once."""
        job = self.job
        if job.phase is not Phase.READY or not job.settings.recovery:
            return []
        down = [m for m in job.members.values() if m.state is NodeState.FAILED]
        if not down:
            return []
        failed = min(down, key=lambda m: (m.role is NodeRole.SERVER, m.rank))
        spare = pick(job.spares.values(), failed, job.members.values())
        return [] if spare is None else self.promote(spare, failed)

    def respare(
        self, member: Member, reg: Registration, now: float
    ) -> tuple[Accepted, list[Effect]]:
        """A node id back after its guard, with its rank taken meanwhile (or a spare's new
        process): a spare, with no new generation unless a rank is down."""
        effects: list[Effect] = [
            Evict(member.node_id, member.incarnation, "replaced by a new process")
        ]
        member.incarnation, member.credential_digest = reg.incarnation, reg.credential_digest
        member.host, member.port = reg.host, reg.port
        self.job.liveness.seen(member, now)
        member.state, member.failure, member.replaced_by = NodeState.ALIVE, "", ""
        member.restarts += 1
        self.job.revision += 1
        return self.job.accepted(rejoined=False, spare=True), effects + self.fill_down_rank()

    def died(self, member: Member, last_seen: float, why: str) -> list[Effect]:
        """Nobody waits for a spare: its record only keeps its id refused for the guard."""
        member.state, member.failure, member.last_seen = NodeState.FAILED, why, last_seen
        self.job.revision += 1
        self.job.liveness.found(expiry(member, self.job.settings))
        return []

    def drop(self, member: Member) -> list[Effect]:
        """A spare that left, or a failed record past its `expiry`: gone."""
        del self.job.spares[member.node_id]
        self.job.forgotten(member.node_id)
        self.job.revision += 1
        return []
