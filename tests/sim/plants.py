"""Planted bugs: switches that break the control plane on purpose, so that the simulation proves
it looks (`python tests/sim/run.py --plant NAME`, `--list-plants`).

Each plant is a subclass of a real part (the scheduler's `SchedulerState`, its `Registrar`,
`SparePool` and `RollbackPlanner`, the `Outbox`), put in by the simulation in place of the real
one; the real code has no switch. A plant of the simulated workers (`keep-abandoned`) is a
switch in the simulation's own code (`putback`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from cluster.protocol import auth
from cluster.protocol.records import (
    Accepted,
    Effect,
    Member,
    NodeRole,
    NodeState,
    Phase,
    Refused,
    Registration,
    TopologyReadyEvent,
)
from cluster.scheduler.machine.admission import Admission, Denied
from cluster.scheduler.machine.liveness import silence_reason
from cluster.scheduler.machine.ready import Outbox, Ready, Tell
from cluster.scheduler.machine.registrar import Registrar
from cluster.scheduler.machine.rollback import NoCommonStep, RollbackPlanner
from cluster.scheduler.machine.rounds import Rounds
from cluster.scheduler.machine.spares import SparePool, live
from cluster.scheduler.machine.state import SchedulerState
from cluster.worker.machine import steps
from cluster.worker.machine.finishing import Away, Finish, Sending, Unheard

# What each plant breaks (`--list-plants`).
PLANTS = {
    "early-release": "the outbox tells what it decided before it is saved",
    "stale-disk": "a restarted scheduler reads the save before the last one",
    "eager-spare": "a spare that registers takes a rank whose holder still lives",
    "no-guard": "a new process of a node id is taken back within MS_NODE_TIMEOUT",
    "newest-min": "the rollback step is the minimum of each rank's newest (MindSpore's rule)",
    "keep-rounds": "a new generation leaves the open rounds of the old one open",
    "kv-early-answer": "a key-value set is answered (and visible) before it is saved",
    "no-step-down": "a leader serves past its lease's end (standbys)",
    "lease-from-receipt": "a leader counts its lease from when etcd's answer came (standbys)",
    "no-fence": "a leader's save lands without its leader key (standbys)",
    "stale-lease-campaign": "a campaign on a lease held before counts the whole lease from the "
    "campaign, the lease not refreshed (standbys)",
    "silent-supersede": "a stream replaced by a newer one of its node is left open, silent "
    "(worker cores)",
    "deaf-rounds": "a restarted scheduler ignores how far a registering node's collectives got",
    "ordered-incarnations": "checkpoint reports are ordered by (incarnation, number) across a "
    "node's processes, though incarnations are random",
    "uncapped-rollback": "a new generation's rollback step is planned from every worker's steps "
    "as reported, those of a worker that has not put back the current one's included",
    "keep-abandoned": "a worker puts back a rollback step and keeps the abandoned run's newer "
    "steps (simulated workers)",
    "finish-failed-member": "a Finish of a failed member the job waits for is answered, uncounted",
    "early-finish-answer": "a Finish is answered before it is saved",
    "uncounted-restore": "a restarted scheduler does not count the nodes that finished",
    "finished-silence": "a finished node's silence fails it",
    "finish-give-up": "a worker holds its Finish for a scheduler that went away only until its "
    "give-up time, then exits as done (worker cores)",
}
# Plants of the election run with standbys (`standbys.py` puts them in).
PLANT_SCHEDULERS = {
    "no-step-down": 2,
    "lease-from-receipt": 2,
    "no-fence": 2,
    "stale-lease-campaign": 2,
}
# Plants that only worker cores can show (`cores.py`): the simulation runs them with cores.
PLANT_CORES = frozenset({"silent-supersede", "finish-give-up"})
# Plants shown where a failure follows a new generation within seconds, a spare taking the
# failed rank each time: the simulation runs them with this many spares at least.
PLANT_SPARES = {"uncapped-rollback": 2}


class EarlyRelease(Outbox):
    """`early-release`: what is decided is told at once, while its save is only asked for (also
    tests/unit/test_ready.py's plant)."""

    def step(self, revision: int, effects: Sequence[Effect]) -> Ready:
        ready = super().step(revision, effects)
        told = [t for _, held in self.held for t in self._tells(revision, held)]
        self.held.clear()
        return Ready(save=ready.save, tell=(*ready.tell, *told))


class KeepRounds(Outbox):
    """`keep-rounds`: telling a new generation fails no round in progress."""

    def _tells(self, revision: int, effects: Sequence[Effect]) -> tuple[Tell, ...]:
        return tuple(
            replace(t, fail=None) if isinstance(t.effect, TopologyReadyEvent) else t
            for t in super()._tells(revision, effects)
        )


class DeafRounds(Rounds):
    """`deaf-rounds`: what a registering node says of its collectives is not heard."""

    def answered_before(self, generation: int, rank: int, answered: int) -> int | None:
        return None


class EagerPool(SparePool):
    """`eager-spare`: with no rank down, a spare takes the lowest rank of a live worker."""

    def fill_down_rank(self) -> list[Effect]:
        job = self.job
        if job.phase is not Phase.READY or not live(job.spares.values()):
            return super().fill_down_rank()
        down = [m for m in job.members.values() if m.state is NodeState.FAILED]
        if down:
            return super().fill_down_rank()
        holders = [m for m in job.members.values() if m.role is NodeRole.WORKER]
        victim = min(holders, key=lambda m: m.rank if m.rank is not None else -1)
        return self.promote(live(job.spares.values())[0], victim)


class NoGuard(Registrar):
    """`no-guard`: a new incarnation of a known node id is never refused by the guard."""

    def _register_known(
        self, member: Member, reg: Registration, now: float
    ) -> tuple[Accepted | Refused, list[Effect]]:
        if member.incarnation != reg.incarnation:
            member.last_seen = min(member.last_seen, now - self.job.settings.node_timeout_s - 1.0)
        return super()._register_known(member, reg, now)


class NewestMin(SchedulerState):
    """`newest-min`: MindSpore's rule, the minimum over the workers of each one's newest step
    (which a worker whose newest is further on may have pruned)."""

    def rollback_step(self) -> int | NoCommonStep:
        newest = [max(m.checkpoints) for m in self._workers() if m.checkpoints]
        return min(newest) if len(newest) == len(self._workers()) else 0


class OrderedIncarnations(RollbackPlanner):
    """`ordered-incarnations`: a report is taken only when its (incarnation, number) is past the
    node's last, as if a new process drew a larger incarnation than the one before."""

    def report(self, node_id: str, incarnation: int, numbered: tuple[int, int], now: int) -> bool:
        if numbered[1] and (incarnation, numbered[1]) <= self._report_seq.get(node_id, (0, 0)):
            return False
        return super().report(node_id, incarnation, numbered, now)


class UncappedRollback(RollbackPlanner):
    """`uncapped-rollback`: every worker's steps count as reported, put back or not (the rule
    before the planner capped them at the rollback step of the generation they are in)."""

    def holdings(
        self, generation: int, workers: Sequence[Member], published_step: int
    ) -> list[Member]:
        return list(workers)


class FailedFinish(Admission):
    """`finish-failed-member`: a failed member's Finish is admitted, though the job waits for it
    to rejoin (the scheduler then answers it without counting it)."""

    def admit_finish(
        self, node_id: str, incarnation: int, presented: auth.Presented
    ) -> Member | Denied:
        return self.admit(node_id, incarnation, presented)


class UncountedRestore(SchedulerState):
    """`uncounted-restore`: a member restored FINISHED is not counted as finished."""

    def add_restored(self, member: Member) -> None:
        super().add_restored(member)
        if member.state is NodeState.FINISHED:
            self._finished -= 1


class FinishedSilence(SchedulerState):
    """`finished-silence`: the silence of a finished member fails it, as an alive one's."""

    def _tick_member(self, member: Member, now: float) -> list[Effect]:
        silent = self.liveness.silence(member, now)
        if member.state is NodeState.FINISHED and silent > self.settings.silence_limit_s:
            return self.lose(member, silence_reason(silent))
        return super()._tick_member(member, now)


class GiveUpFinish(Finish):
    """`finish-give-up`: a Finish held for a scheduler that went away is held only until its
    give-up time (MS_NODE_TIMEOUT and FINISH_SLACK_S from its send), then ends unheard."""

    def failed(
        self, event: steps.FinishFailed, *, away: Away | None, **given: bool | str
    ) -> list[steps.Action] | Unheard:
        if away is not None:
            away = Away(away.why, min(away.until, self._since + self.wait_s))
        return super().failed(event, away=away, **given)  # type: ignore[arg-type]

    def retry_due(self, *, finished: bool, away: Away | None) -> list[steps.Action] | Unheard:
        now, give_up = self._clock(), self._since + self.wait_s
        if self.sending is Sending.HELD and not finished and away is not None and now >= give_up:
            self.sending = Sending.SENT
            why = f"this node was not back with it within {self.wait_s:g} s"
            return Unheard(False, now - self._since, why)
        return super().retry_due(finished=finished, away=away)


STATES: dict[str, type[SchedulerState]] = {
    "newest-min": NewestMin,
    "uncounted-restore": UncountedRestore,
    "finished-silence": FinishedSilence,
}


def state_kind(plant: str) -> type[SchedulerState]:
    """The scheduler state the simulation runs with `plant`."""
    return STATES.get(plant, SchedulerState)


def planted(state: SchedulerState, plant: str) -> SchedulerState:
    """`state` with the plant's parts put in (a planner's: with what the state's held)."""
    if plant == "eager-spare":
        state.pool = EagerPool(state)
    if plant == "no-guard":
        state.registrar = NoGuard(state)
    if plant == "finish-failed-member":
        state.admission = FailedFinish(state)
    planner = {"ordered-incarnations": OrderedIncarnations, "uncapped-rollback": UncappedRollback}
    if plant in planner:
        saved = state.rollback.saved()
        state.rollback = planner[plant]()
        state.rollback.restored(saved)
    return state


def rounds_kind(plant: str) -> type[Rounds]:
    return DeafRounds if plant == "deaf-rounds" else Rounds


def outbox_kind(plant: str) -> type[Outbox]:
    return {"early-release": EarlyRelease, "keep-rounds": KeepRounds}.get(plant, Outbox)


__all__ = [
    "PLANTS",
    "PLANT_CORES",
    "PLANT_SCHEDULERS",
    "PLANT_SPARES",
    "DeafRounds",
    "EagerPool",
    "EarlyRelease",
    "FailedFinish",
    "FinishedSilence",
    "GiveUpFinish",
    "KeepRounds",
    "NewestMin",
    "NoGuard",
    "OrderedIncarnations",
    "UncappedRollback",
    "UncountedRestore",
    "outbox_kind",
    "rounds_kind",
]
