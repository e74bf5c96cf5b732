"""Standby schedulers in the simulation: several scheduler processes of one job, each with the
real election rules (`cluster.protocol.leadership.Leadership`), and a simulated etcd
(`LeaseStore`): a leader key on a lease, campaigns and keepalives that travel the simulated
network (delayed, dropped, cut), and saves fenced by the leader's lease, as
`cluster.scheduler.leading` and the etcd store do them.

The job's machine (its state, outbox, streams, rounds and key-value table: `Sim`) runs in the
scheduler that leads. A scheduler that does not lead answers nothing for the job; a worker
whose call finds no leader calls again (as the worker core tries every scheduler address and
follows the one a standby names). A new leader loads the job from the store as a restarted
scheduler does (`Sim.restore_machine`), and the connections to the old one break.

Faults (`fault`): a scheduler cut from etcd and healed, stopped (SIGSTOP) and continued, killed
(its launcher starts it again later). Invariants (`Violation.invariant`):

- `one-leader`: two schedulers never serve the job at once: when one wins the election, and
  whenever one runs, no other may still serve by its own rules;
- `fencing`: a save lands only from the leader of the newest term: a stopped leader that
  continues after another took over never writes over its state.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.protocol.leadership import Leadership, Role, Step
from cluster.protocol.state_url import DEFAULT_LEASE_S
from tests.sim.network import ETCD, Packet

if TYPE_CHECKING:
    from tests.sim.control_plane import Sim

LEASE_S = float(DEFAULT_LEASE_S)  # the leader's lease when the environment names none
CALL_TIMEOUT_S = 5.0  # an etcd call with no answer by then is made again
NAMES = ("sched-a", "sched-b", "sched-c")


@dataclass
class LeaseStore:
    """etcd as the election sees it: each scheduler process's lease (when it ends, on etcd's
    clock: from when a keepalive *arrived*), who holds the leader key (on its holder's lease),
    and how many terms were won."""

    lease_s: float
    holder: str | None = None
    leases: dict[str, float] = field(default_factory=dict)
    term: int = 0

    def ends(self, name: str) -> float:
        return self.leases.get(name, -math.inf)

    def holds(self, name: str, term: int, at: float) -> bool:
        """Whether `name`'s leader key of `term` is the one in etcd at `at` (the fence: a new
        term is a new key, even on the same lease)."""
        return self.holder == name and self.term == term and at < self.ends(name)

    def campaign(self, name: str, at: float, *, refresh: bool = True) -> bool:
        """The leader key put on the candidate's lease: the one it holds while that lives (as
        `EtcdElection.ensure_lease` keeps it; `refresh`: a keepalive lands just before, as
        `Leading` sends one), a new one otherwise. Its own key, left from before it stepped
        down, is deleted first (`drop_stale`)."""
        holder = self.holder
        if holder is not None and holder != name and at < self.ends(holder):
            return False
        if refresh or at >= self.ends(name):
            self.leases[name] = at + self.lease_s
        self.holder, self.term = name, self.term + 1
        return True

    def keepalive(self, name: str, at: float) -> bool:
        if at >= self.ends(name):
            return False
        self.leases[name] = at + self.lease_s
        return True

    def forget(self, name: str) -> None:
        """A new process of `name`: it grants a lease of its own (the old one, and the leader
        key on it, are dropped as `drop_stale` does)."""
        self.leases.pop(name, None)


class NoStepDown(Leadership):
    """`no-step-down`: a leader serves while it believes it leads, its lease's end or not."""

    def serving(self) -> bool:
        return self.role is Role.LEADER

    def tick(self) -> Step:
        return Step.NOTHING


@dataclass
class Scheduler:
    """One scheduler process of the job."""

    name: str
    leadership: Leadership
    running: bool = True
    stopped: bool = False
    inbox: list[Packet] = field(default_factory=list)  # what arrived while stopped
    term: int = 0  # the term it leads in, as etcd counted it
    asked: float | None = None  # when the campaign on its way was sent
    next_keepalive: float = -math.inf
    # A save it was making when another scheduler took the job over from it (stopped): its term.
    pending: int | None = None


class Standbys:
    def __init__(self, sim: Sim, count: int, plant: str) -> None:
        self.sim = sim
        self.plant = plant
        self.rng = random.Random(sim.seed * 7919 + count)  # its own stream: faults, choices
        self.store = LeaseStore(LEASE_S)
        self.scheds = {name: self._process(name) for name in NAMES[:count]}
        self.leader: str | None = None  # the scheduler whose process runs the job's machine

    def _process(self, name: str) -> Scheduler:
        kind = NoStepDown if self.plant == "no-step-down" else Leadership
        return Scheduler(name, kind(LEASE_S, self.sim.clock))

    def start(self) -> None:
        """The first scheduler leads from the start (the job's machine is new, nothing to load)."""
        first = self.scheds[NAMES[0]]
        now = self.sim.clock.now
        self.store.campaign(first.name, now)
        first.leadership.won(now, LEASE_S, first.name)
        first.term, first.next_keepalive = self.store.term, now
        self.leader = first.name

    def serving(self) -> bool:
        """Whether the job's machine may answer now (the gate asks `serving()` per call)."""
        if self.leader is None:
            return False
        sched = self.scheds[self.leader]
        return sched.running and not sched.stopped and sched.leadership.serving()

    # -- the election, each second ----------------------------------------------------------

    def beat(self) -> None:
        for sched in self.scheds.values():
            if sched.running and not sched.stopped:
                self.elect(sched)

    def elect(self, sched: Scheduler) -> None:
        now, rules = self.sim.clock.now, sched.leadership
        if rules.role is Role.LEADER:
            if rules.tick() is Step.STEP_DOWN:
                self.step_down(sched)
            elif now >= sched.next_keepalive:
                sched.next_keepalive = now + rules.keepalive_every_s
                self.sim.net.send(now, sched.name, ETCD, ("keepalive", now))
        elif sched.asked is None or now - sched.asked >= CALL_TIMEOUT_S:
            sched.asked = now
            self.sim.net.send(now, sched.name, ETCD, ("campaign", now))

    def to_etcd(self, packet: Packet) -> None:
        kind, sent = packet.body
        name, at, store = packet.src, self.sim.clock.now, self.store
        if kind == "campaign":
            won = store.campaign(name, at, refresh=self.plant != "stale-lease-campaign")
            answer = ("won", sent, store.term) if won else ("lost", sent, store.holder or "")
        else:
            answer = ("kept", sent) if store.keepalive(name, at) else ("ended", sent)
        self.sim.net.send(at, ETCD, name, answer)

    def to_scheduler(self, sched: Scheduler, packet: Packet) -> None:
        if not sched.running:
            return
        if sched.stopped:
            sched.inbox.append(packet)
            return
        kind, rules = packet.body[0], sched.leadership
        if kind in ("won", "lost"):
            if sched.asked != packet.body[1]:
                return  # the answer to an earlier campaign (a retry's twin)
            sched.asked = None
            if kind == "won":
                self.lead(sched, packet)
            elif rules.role is not Role.STANDBY or rules.leader != packet.body[2]:
                rules.lost(packet.body[2])
                self.sim.note(f"{sched.name} stands by: {packet.body[2]} leads")
        elif kind == "kept":
            if rules.kept(self.sent_at(packet), LEASE_S) is Step.STEP_DOWN:
                self.step_down(sched)
        elif kind == "ended" and rules.lease_ended() is Step.STEP_DOWN:
            self.step_down(sched)

    def sent_at(self, packet: Packet) -> float:
        """When the call was sent (the election counts from then); `lease-from-receipt` plants
        counting from when the answer came."""
        return self.sim.clock.now if self.plant == "lease-from-receipt" else packet.body[1]

    def lead(self, sched: Scheduler, won: Packet) -> None:
        if sched.leadership.won(self.sent_at(won), LEASE_S, sched.name) is not Step.LEAD:
            return
        term = won.body[2]
        sched.term, sched.next_keepalive = term, self.sim.clock.now
        self.check_one_leader(sched)
        old = self.leader
        if old is not None:
            if self.sim.save_pending():
                self.scheds[old].pending = self.scheds[old].term
            self.sim.drop_machine()
        self.leader = sched.name
        self.sim.restore_machine(f"{sched.name} leads (term {term})")

    def step_down(self, sched: Scheduler, why: str = "") -> None:
        """`Step.STEP_DOWN`: it stops serving at once and drops the job's state."""
        if self.leader == sched.name:
            self.leader = None
            self.sim.drop_machine()
            self.sim.note(f"{sched.name} steps down: {why or sched.leadership.reason}")

    # -- saves ------------------------------------------------------------------------------

    def may_save(self) -> bool:
        """Whether the leader's save reaches etcd and lands (its link up, its lease alive: the
        transaction is fenced by its leader key); a fenced save makes it step down."""
        if self.leader is None:
            return False
        sched = self.scheds[self.leader]
        if sched.stopped or sched.name in self.sim.net.cut:
            return False
        if self.plant == "no-fence" or self.store.holds(sched.name, sched.term, self.now()):
            self.check_fenced(sched.term, sched.name)
            return True
        if sched.leadership.fenced("its leader key is gone: a save was refused") is Step.STEP_DOWN:
            self.step_down(sched)
        return False

    def check_fenced(self, term: int, name: str) -> None:
        if term < self.store.term:
            raise self.sim.violation(
                "fencing",
                f"{name} saved the job as the leader of term {term}, over term "
                f"{self.store.term} of {self.store.holder}",
            )

    # -- faults -----------------------------------------------------------------------------

    def fault(self) -> tuple[str, object]:
        """A fault of a scheduler process or of its link to etcd, chosen from its own stream."""
        sched = self.rng.choice(list(self.scheds.values()))
        roll = self.rng.random()
        if roll < 0.25:
            return f"stop {sched.name}", lambda: self.stop(sched)
        if roll < 0.5:
            return f"continue {sched.name}", lambda: self.resume(sched)
        if roll < 0.65:
            return f"partition {sched.name} etcd", lambda: self.sim.net.partition(sched.name)
        if roll < 0.8:
            return f"heal {sched.name} etcd", lambda: self.sim.net.heal(sched.name, self.now())
        if roll < 0.9:
            return f"kill {sched.name}", lambda: self.kill(sched)
        return f"start {sched.name}", lambda: self.restart(sched)

    def now(self) -> float:
        return self.sim.clock.now

    def stop(self, sched: Scheduler) -> None:
        sched.stopped = sched.running

    def resume(self, sched: Scheduler) -> None:
        """SIGCONT: what was pending runs first (a save being retried, then what arrived)."""
        if not sched.stopped:
            return
        sched.stopped = False
        if sched.pending is not None:
            term, sched.pending = sched.pending, None
            if self.plant == "no-fence":
                self.check_fenced(term, sched.name)
            else:
                sched.leadership.fenced("its leader key is gone: a save was refused")
                self.sim.note(
                    f"{sched.name} continues: the save it was making as the leader of term "
                    f"{term} is refused (term {self.store.term} leads); it serves nothing"
                )
        inbox, sched.inbox = sched.inbox, []
        for packet in inbox:
            self.to_scheduler(sched, packet)
        self.check_one_leader(sched)
        if self.leader == sched.name:
            self.sim.leader_continues()

    def kill(self, sched: Scheduler) -> None:
        if not sched.running:
            return
        self.step_down(sched, "killed")
        sched.running, sched.stopped, sched.inbox, sched.pending = False, False, [], None

    def restart(self, sched: Scheduler) -> None:
        """Its launcher starts it again: a new process, a candidate."""
        if not sched.running:
            self.store.forget(sched.name)
            self.scheds[sched.name] = self._process(sched.name)

    def heal(self) -> None:
        """Faults stop: stopped schedulers continue, dead ones start again."""
        for sched in list(self.scheds.values()):
            self.resume(sched)
            self.restart(sched)

    # -- checks -----------------------------------------------------------------------------

    def check_one_leader(self, sched: Scheduler | None = None) -> None:
        serving = [
            s.name
            for s in self.scheds.values()
            if s.running and not s.stopped and s.leadership.serving()
        ]
        if len(serving) > 1:
            raise self.sim.violation(
                "one-leader",
                f"{' and '.join(serving)} both serve the job"
                + (f" (as {sched.name} runs)" if sched is not None else ""),
            )


__all__ = ["LEASE_S", "LeaseStore", "NoStepDown", "Scheduler", "Standbys"]
