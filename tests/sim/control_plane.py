"""A seeded simulation of the control plane: the scheduler's pure machine and its write-ahead
order, a simulated disk, worker processes that register, beat, die and come back, and
scheduler restarts from what the disk holds, all on one virtual clock and one seed.

A first slice of issue #27: the workers are simple processes here (not `WorkerCore`), the
network delivers at once, and there are no standbys. What it checks after every step:

- no node is told an effect whose revision is not saved (`Outbox`, at the level of the job);
- what a node was told is never forgotten: a scheduler restarted from the disk is at least at
  every generation any node was told;
- each node hears generations that only grow;
- a generation's rollback step is held by every rank it names (as the ranks reported it);
- a failure is told once;
- at most one live member holds each rank;
- when the faults stop, the job forms again within a bounded virtual time (liveness).

Same seed, same run: every choice comes from `random.Random(seed)`.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from cluster.protocol import auth
from cluster.protocol.records import (
    Accepted,
    Effect,
    NodeFailedEvent,
    NodeRole,
    NodeState,
    Phase,
    Refused,
    Registration,
    TopologyReadyEvent,
)
from cluster.protocol.settings import JobSettings
from cluster.scheduler.machine.ready import Outbox, Ready
from tests.sim.plants import PLANTS, EarlyRelease, outbox_kind, planted, state_kind

NODE_TIMEOUT_S = 10.0
HEARTBEAT_S = 1.0


class Violation(AssertionError):
    """An invariant of the control plane broke: which, and the trace that led there."""


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Process:
    """A worker process: its node id, its incarnation, whether it runs and is connected, and
    what it was told."""

    node_id: str
    port: int
    spare: bool = False  # started as a spare (CLUSTER_SPARE=1)
    incarnation: int = 0
    running: bool = False
    member: bool = False  # accepted by the scheduler it talks to now
    refused: str = ""  # why its last registration was refused for good (it exited)
    # The generations it heard, per job (a scheduler that restarts on an ended job's state
    # starts a new job, whose generations count from 1 again).
    generations: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Sim:
    seed: int
    workers: int = 3
    plant: str = ""
    spares: int = 1
    trace: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.clock = Clock()
        self.settings = JobSettings(
            worker_num=self.workers,
            server_num=0,
            node_timeout_s=NODE_TIMEOUT_S,
            topo_timeout_s=120.0,
            heartbeat_interval_s=HEARTBEAT_S,
            recovery=True,
        )
        self.state = planted(state_kind(self.plant)("job-0", self.settings, self.clock), self.plant)
        self.stored: dict[str, Any] = self.state.snapshot()  # the first save
        self.previous = self.stored
        self.outbox = self._outbox(-1)
        self.carry_out(self.outbox.advance(self.state.revision))
        names = [str(i) for i in range(self.workers)] + [f"s{i}" for i in range(self.spares)]
        self.processes = {
            name: Process(name, 5000 + i, spare=name.startswith("s"))
            for i, name in enumerate(names)
        }
        # The checkpoint files of each rank (on the one host, so that they outlive a process
        # and a spare that takes the rank reads them), and the step the scheduler said every
        # worker holds (no rank prunes from there up).
        self.files: dict[int, set[int]] = {}
        self.keep_from: dict[int, int] = {}
        # The peers of each job's last generation told, and when the scheduler last heard each
        # node id (register, connect, heartbeat): the guard counts from there.
        self.peers_told: dict[str, dict[int, str]] = {}
        self.heard: dict[str, float] = {}
        self.restarts = 0
        self.told = 0
        # (job, node, rank, generation) of every failure told
        self.failures_told: set[tuple[str, str, int, int]] = set()

    # -- the scheduler side ----------------------------------------------------------------

    def _outbox(self, saved: int) -> Outbox:
        return outbox_kind(self.plant)(write_ahead=True, saved=saved, recovery=True)

    def step_machine(self, effects: list[Effect]) -> None:
        self.carry_out(self.outbox.step(self.state.revision, effects))

    def carry_out(self, ready: Ready) -> None:
        saved = int(self.stored["revision"])
        for tell in ready.tell:
            if tell.revision > saved:
                raise Violation(f"told revision {tell.revision} with {saved} saved: {tell.effect}")
            self.told += 1
            if isinstance(tell.effect, NodeFailedEvent):
                failed = tell.effect
                key = (self.state.cluster_id, failed.node_id, failed.rank, failed.generation)
                if key in self.failures_told:
                    raise Violation(f"failure told twice: {failed}")
                self.failures_told.add(key)
            if isinstance(tell.effect, TopologyReadyEvent):
                self.check_rollback(tell.effect)
                self.check_handover(tell.effect)
                job = self.state.cluster_id
                for proc in self.processes.values():
                    if proc.running and proc.member:
                        proc.generations.setdefault(job, []).append(tell.effect.generation)

    def check_rollback(self, ready: TopologyReadyEvent) -> None:
        """The step a generation rolls back to is on disk for every rank it names."""
        if ready.rollback_step == 0:
            return
        for peer in ready.peers:
            held = self.files.get(peer.rank, set())
            if ready.rollback_step not in held:
                raise Violation(
                    f"generation {ready.generation} rolls back to step {ready.rollback_step}, "
                    f"which rank {peer.rank} ({peer.node_id}) does not hold ({sorted(held)})"
                )

    def check_handover(self, ready: TopologyReadyEvent) -> None:
        """A rank goes to another node only once its holder's failure was told."""
        job = self.state.cluster_id
        before = self.peers_told.get(job, {})
        for peer in ready.peers:
            holder = before.get(peer.rank, peer.node_id)
            if holder != peer.node_id and not any(
                k[:3] == (job, holder, peer.rank) for k in self.failures_told
            ):
                raise Violation(
                    f"generation {ready.generation} gives rank {peer.rank} to {peer.node_id}, "
                    f"but the failure of its holder {holder} was never told"
                )
        self.peers_told[job] = {p.rank: p.node_id for p in ready.peers}

    def report(self, proc: Process) -> None:
        """The process trained on and saved a checkpoint of its rank; the rank keeps its newest
        three and every step from the one all workers hold (as a `CheckpointManager` prunes),
        and reports them; the scheduler answers the step every worker holds."""
        member = self.state.find(proc.node_id)
        if not (proc.running and proc.member) or self.state.phase is not Phase.READY:
            return  # a worker saves checkpoints once the job has formed (after init())
        if member is None or member.rank is None or member.incarnation != proc.incarnation:
            return
        files = self.files.setdefault(member.rank, set())
        files.add(max(files, default=0) + 10 * self.rng.randrange(1, 3))
        keep = self.keep_from.get(member.rank, 0)
        files &= {s for s in files if s >= keep} | set(sorted(files)[-3:])
        self.state.report_checkpoints(proc.node_id, proc.incarnation, sorted(files))
        self.keep_from[member.rank] = max(keep, self.state.held_by_all())
        self.step_machine([])  # saves the holdings

    def save_lands(self) -> None:
        if self.outbox.requested > int(self.stored["revision"]):
            self.previous, self.stored = self.stored, self.state.snapshot()  # the newest
            self.carry_out(self.outbox.advance(int(self.stored["revision"])))

    def restart_scheduler(self) -> None:
        """The scheduler dies and comes back on what the disk holds; every process is cut off
        and registers again."""
        self.restarts += 1
        if self.plant == "stale-disk":
            self.stored = self.previous
        restored = state_kind(self.plant).restore(
            self.stored, self.settings, self.clock, new_cluster_id=f"job-{self.restarts}"
        )
        self.state = planted(restored, self.plant)
        for node_id in self.heard:
            self.heard[node_id] = self.clock.now  # the restored guard counts from now
        self.outbox = self._outbox(int(self.stored["revision"]))
        job = self.state.cluster_id
        told = max(
            (g for p in self.processes.values() for g in p.generations.get(job, [])), default=0
        )
        if self.state.phase is Phase.READY and self.state.generation < told:
            raise Violation(
                f"restarted at generation {self.state.generation}, a node was told {told}"
            )
        for proc in self.processes.values():
            proc.member = False

    # -- the workers ---------------------------------------------------------------------

    def registration(self, proc: Process) -> Registration:
        return Registration(
            node_id=proc.node_id,
            role=NodeRole.WORKER,
            host="h0",
            port=proc.port,
            incarnation=proc.incarnation,
            worker_num=self.workers,
            server_num=0,
            cluster_id=self.state.cluster_id if self.state.cluster_id in proc.generations else "",
            credential_digest=auth.credential_digest(f"{proc.node_id}:{proc.incarnation}".encode()),
            spare=proc.spare,
        )

    def register(self, proc: Process) -> None:
        if not proc.running:
            proc.running, proc.incarnation = True, proc.incarnation + 1
        known = self.state.find(proc.node_id)
        before = None if known is None else known.incarnation
        outcome, effects = self.state.register(self.registration(proc))
        proc.refused = ""
        if isinstance(outcome, Refused) and not outcome.reason.transient:
            proc.running, proc.refused = False, outcome.reason.value  # it exits, told why
        if isinstance(outcome, Accepted):
            self.check_guard(proc, before)
            proc.member = True
            self.state.connect(proc.node_id, proc.incarnation)
            self.heard[proc.node_id] = self.clock.now
        self.step_machine(effects)

    def check_guard(self, proc: Process, before: int | None) -> None:
        """A new process of a known node id is taken only after MS_NODE_TIMEOUT of silence."""
        silent = self.clock.now - self.heard.get(proc.node_id, float("-inf"))
        if before not in (None, proc.incarnation) and silent < NODE_TIMEOUT_S:
            raise Violation(
                f"node {proc.node_id} incarnation {proc.incarnation} was accepted {silent:g} s "
                f"after incarnation {before} was last heard (guard {NODE_TIMEOUT_S:g} s)"
            )

    def kill(self, proc: Process) -> None:
        if proc.running:
            proc.running = False
            if proc.member:
                proc.member = False
                self.step_machine(self.state.disconnect(proc.node_id, proc.incarnation))

    def time_passes(self, seconds: float) -> None:
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.now = min(end, self.clock.now + HEARTBEAT_S)
            for proc in self.processes.values():
                if proc.running and proc.member:
                    self.state.heartbeat(proc.node_id, proc.incarnation)
                    self.heard[proc.node_id] = self.clock.now
            self.step_machine(self.state.tick())

    # -- checks --------------------------------------------------------------------------

    def check(self) -> None:
        for proc in self.processes.values():
            for job, seen in proc.generations.items():
                if any(b <= a for a, b in itertools.pairwise(seen)):
                    raise Violation(f"node {proc.node_id} heard generations {seen} of {job}")
        holders: dict[int, str] = {}
        for member in self.state.members.values():
            if member.state is NodeState.ALIVE and member.rank is not None:
                if member.rank in holders:
                    raise Violation(
                        f"rank {member.rank}: {holders[member.rank]} and {member.node_id}"
                    )
                holders[member.rank] = member.node_id

    # -- one schedule --------------------------------------------------------------------

    def act(self) -> str:  # noqa: PLR0911 - one return per kind of step
        roll = self.rng.random()
        proc = self.rng.choice(list(self.processes.values()))
        if roll < 0.30:
            self.register(proc)
            return f"register {proc.node_id}"
        if roll < 0.35:
            self.report(proc)
            return f"report {proc.node_id}"
        if roll < 0.45:
            self.kill(proc)
            return f"kill {proc.node_id}"
        if roll < 0.70:
            seconds = self.rng.choice([0.5, 2.0, 11.0])
            self.time_passes(seconds)
            return f"time +{seconds:g}s"
        if roll < 0.90:
            self.save_lands()
            return "save lands"
        if roll < 0.95:
            return "save fails"
        self.restart_scheduler()
        return "scheduler restarts"

    def heal(self, bound_s: float = 600.0) -> None:
        """Faults stop: every process runs and registers, saves land, time passes; within
        `bound_s` of virtual time the job must be formed with every process in it, or over with
        its end told."""
        start = self.clock.now
        while self.clock.now - start < bound_s:
            over = self.state.phase in (Phase.FINISHED, Phase.FAILED)
            for proc in self.processes.values():
                if not (proc.member or proc.refused or over):
                    self.register(proc)
            self.save_lands()
            everyone = all(p.member or p.refused for p in self.processes.values())
            ranked = all(
                m.state is NodeState.ALIVE and self.processes[m.node_id].member
                for m in self.state.members.values()
            )
            formed = self.state.phase is Phase.READY and everyone and ranked
            if (formed or over) and self.outbox.waiting == 0:
                return
            self.time_passes(2.0)
            self.check()
        raise Violation(
            f"the job did not form within {bound_s:g} s of virtual time after the faults"
        )

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.trace.append(self.act())
            self.check()
        self.trace.append("heal")
        self.heal()


def run_seed(
    seed: int, steps: int = 200, workers: int = 3, plant: str = "", spares: int = 1
) -> Sim:
    sim = Sim(seed, workers, plant, spares)
    try:
        sim.run(steps)
    except Violation as exc:
        raise Violation(f"seed {seed}: {exc}\n  last steps: {sim.trace[-12:]}") from None
    return sim


__all__ = ["PLANTS", "EarlyRelease", "Sim", "Violation", "run_seed"]
