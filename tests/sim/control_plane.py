"""A seeded simulation of the control plane: the scheduler's pure machine and its write-ahead
order, a simulated disk, a simulated network (`network`), worker processes and a spare that
register, beat, train, save and report checkpoints, die, stop and continue, and come back
through the guard, and scheduler restarts from what the disk holds, all on one virtual clock
and one seed.

The workers are simple processes here (not `WorkerCore`): they know only what the network
brought them. What is checked, after every step and at every message (`Violation.invariant`
names the rule):

- `write-ahead`: no node is told an effect whose revision is not saved (`Outbox`);
- `generations`: each node hears generations that only grow, and a scheduler restarted from
  the disk is at least at every generation any node was told;
- `rollback`: a generation's rollback step is on disk for every rank it names, when it is told
  and when the rank's process hears it as the job's newest generation;
- `lineage`: that step is one state on every rank that holds it, a step of one run, not a
  rank's step of a run the others abandoned (the workers put each rollback step back:
  `putback`);
- `failure-once`: each failure is told once;
- `report-taken`: a checkpoint report of a member's process, newer than every report of that
  process heard before, is what the scheduler holds for it (processes draw random
  incarnations and number their reports from 1, as real ones do);
- `one-holder`: at most one live member holds each rank, and a rank goes to another node only
  once its holder's failure was told;
- `guard`: a new process of a node id is taken only after MS_NODE_TIMEOUT of its silence;
- `liveness`: when the faults stop, within a bounded virtual time the job ends and every
  process is told (where the workers hold: the job forms again with every process in it but
  those that finished);
- the end of the job (`finishing`): a Finish heard is saved and never lost to a restart
  (`finish-counted`), a job whose every rank finished ends well (`job-end`), a finished node
  reports no failure (`finished-quiet`), a Finish cut off with its scheduler is held, never
  given up silently (`finish-held`).

Same seed, same run: every choice comes from `random.Random(seed)`.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from cluster.protocol import auth, version
from cluster.protocol.errors import EvictedError, UnknownNodeError
from cluster.protocol.records import (
    Accepted,
    Effect,
    Evict,
    NodeFailedEvent,
    NodeRole,
    NodeState,
    Phase,
    Refused,
    Registration,
    ShutdownEvent,
    TopologyReadyEvent,
)
from cluster.protocol.settings import JobSettings
from cluster.scheduler.machine.ready import Outbox, Ready, Tell
from tests.sim import putback
from tests.sim.collectives import Collectives
from tests.sim.cores import Cores
from tests.sim.disks import kill_with_disk, may_lose_disk
from tests.sim.finishing import Finishes
from tests.sim.kv import KvSim
from tests.sim.network import ETCD, SCHED, Network, Packet
from tests.sim.plants import (
    PLANT_CORES,
    PLANT_SCHEDULERS,
    PLANT_SPARES,
    PLANTS,
    EarlyRelease,
    outbox_kind,
    planted,
    rounds_kind,
    state_kind,
)
from tests.sim.standbys import Standbys

NODE_TIMEOUT_S = 10.0
START_S = 1000.0
HEARTBEAT_S = 1.0
LIVENESS_BOUND_S = 600.0


class Violation(AssertionError):
    """An invariant of the control plane broke: which (`invariant`), and how."""

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"[{invariant}] {message}")
        self.invariant = invariant


def describe(effect: Effect | Accepted | Refused) -> str:  # noqa: PLR0911 - one per kind
    """One line for a transcript."""
    if isinstance(effect, TopologyReadyEvent):
        ranks = " ".join(f"{p.rank}={p.node_id}" for p in effect.peers)
        return (
            f"ready: generation {effect.generation}, from step {effect.rollback_step}, "
            f"ranks {ranks} ({effect.reason})"
        )
    if isinstance(effect, NodeFailedEvent):
        return f"failed: rank {effect.rank} ({effect.node_id}): {effect.reason}"
    if isinstance(effect, ShutdownEvent):
        return f"shutdown: {'ok' if effect.ok else 'failed'}: {effect.reason}"
    if isinstance(effect, Evict):
        return f"evict: {effect.node_id} incarnation {effect.incarnation}"
    if isinstance(effect, Accepted):
        how = "a spare" if effect.spare else "rejoined" if effect.rejoined else "registered"
        return f"accepted, {how}, generation {effect.generation} of {effect.cluster_id}"
    if isinstance(effect, Refused):
        retry = f", retry in {effect.retry_after_s:.0f} s" if effect.retry_after_s else ""
        return f"refused ({effect.reason.value}{retry}): {effect.message.split(';')[0]}"
    return f"progress: {effect.registered} of {effect.expected} registered"


@dataclass
class Clock:
    now: float = START_S

    def __call__(self) -> float:
        return self.now


@dataclass
class Process:
    """A worker process: what it is, whether it runs, and what it was told."""

    node_id: str
    port: int
    spare: bool = False  # started as a spare (CLUSTER_SPARE=1)
    incarnation: int = 0  # drawn at random per process (`Sim.new_incarnation`)
    running: bool = False
    stopped: bool = False  # SIGSTOP: it neither sends nor reads until continued
    inbox: list[Packet] = field(default_factory=list)  # what arrived while stopped
    member: bool = False  # accepted, its stream open, as far as it knows
    ended: str = ""  # why it exited for good (a refusal or the job's end), as told
    job: str = ""  # the job it was accepted into
    rank: int | None = None  # its rank in the newest generation it heard
    paused: bool = False  # heard a failure, waits for the next generation
    reports: int = 0  # this process's checkpoint reports so far (numbered from 1, as a worker's)
    # Its put-back of rollback steps (`putback`): per job, the generation whose step it put
    # back; the generation and step it is putting back; the write its checkpoint writer has
    # under way (step, run); its put-back report, until answered.
    put_back: dict[str, int] = field(default_factory=dict)
    restoring: tuple[int, int] | None = None
    committed: tuple[int, int] | None = None  # past the allgather: put back whatever comes
    step: int = 0  # the step its loop reached (`putback.step`)
    writing: tuple[int, int] | None = None
    awaiting: tuple[Any, ...] | None = None
    # Its last report sent and the number of the newest answered (its flush at the end waits
    # for it); past its end barrier; finalize() called (`finishing`).
    last_report: tuple[Any, ...] | None = None
    answered_report: int = 0
    past_end: bool = False
    finishing: bool = False
    # The generations it heard, per job (a scheduler that restarts on an ended job's state
    # starts a new job, whose generations count from 1 again).
    generations: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Sim:
    seed: int
    workers: int = 3
    plant: str = ""
    spares: int = 1
    schedulers: int = 1  # more: standbys on a simulated etcd (`standbys`)
    worker_cores: bool = False  # the workers run the real worker core (`cores`)
    trace: list[str] = field(default_factory=list)
    # For transcripts (`tests/sim/transcript.py`): the node ids (a name starting with "s" is a
    # spare), the guard, whether every heartbeat second ends in a collective and the workers
    # put their rollback steps back on their own (`putback`; a transcript says what each rank
    # holds), and the lines that say what the scheduler did (None: not kept).
    names: list[str] | None = None
    node_timeout_s: float = NODE_TIMEOUT_S
    collective_steps: bool = True
    log: list[str] | None = None
    finishing: bool = True  # the workers train to an end and finish (`finishing`)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.clock = Clock()
        self.net = Network(random.Random(self.rng.random()))
        self.settings = JobSettings(
            worker_num=self.workers,
            server_num=0,
            node_timeout_s=self.node_timeout_s,
            topo_timeout_s=120.0,
            heartbeat_interval_s=HEARTBEAT_S,
            recovery=True,
        )
        self.state = planted(state_kind(self.plant)("job-0", self.settings, self.clock), self.plant)
        self.stored: dict[str, Any] = self.state.snapshot()  # the first save
        self.previous = self.stored
        self.outbox = self._outbox(-1)
        names = self.names or (
            [str(i) for i in range(self.workers)] + [f"s{i}" for i in range(self.spares)]
        )
        self.processes = {
            name: Process(name, 5000 + i, spare=name.startswith("s"))
            for i, name in enumerate(names)
        }
        # The scheduler's open streams, and what a stream opened now starts with.
        # (node id, incarnation) -> the number of the node's current stream (each accepted
        # registration opens one): only that one speaks for the node.
        self.streams: dict[tuple[str, int], int] = {}
        self.stream_numbers = itertools.count(1)
        self.catch_up: list[Effect] = []
        # The checkpoint files of each rank (on the one host, so that they outlive a process
        # and a spare that takes the rank reads them), and the step the scheduler said every
        # worker holds (no rank prunes from there up).
        self.files: dict[int, set[int]] = {}
        self.keep_from: dict[int, int] = {}
        # The run each file's state comes from (rank -> step -> the generation that computed
        # it), and the group's run: the label of each step it holds (`putback`).
        self.labels: dict[int, dict[int, int]] = {}
        self.lineage: dict[int, int] = {}
        self.late_rng = random.Random(self.seed * 32452843 + 4)  # writes a save behind
        # Per job: the peers of the last generation told, the newest generation told.
        self.peers_told: dict[str, dict[int, str]] = {}
        self.generation_told: dict[str, int] = {}
        # (job, node, rank, generation) of every failure told.
        self.failures_told: set[tuple[str, str, int, int]] = set()
        self.failed_in: dict[str, int] = {}  # per job, the generation of the newest failure told
        # When the scheduler last heard each node id (register, connect, heartbeat).
        self.heard: dict[str, float] = {}
        self.restarts = 0
        # Answers to checkpoint reports, held until their revision is saved.
        self.answers: list[tuple[int, str, tuple[Any, ...]]] = []
        # Registrations accepted, answered once their revision is saved: (revision, ...).
        self.opening: list[tuple[int, Registration, Accepted, int]] = []
        self.told = 0
        self.progress = 0  # the step the training group reached
        self.next_beat = self.clock.now
        # The workers hold (call no new collective: a long step, or the end of the job) once
        # the faults stop or the crash point fires, in every third schedule: a round the
        # scheduler answered to some ranks only before it died must then be re-formed without
        # anyone calling past it.
        self.holding = False
        # Every third schedule of one scheduler arms a crash point at a step its own stream
        # picks (the schedule's other draws stay as they were): the scheduler dies while it
        # answers the next round to complete, to some of its callers only (`crash_after` says
        # which; `crash_answering`).
        self.crash_after = ""
        self.crash_rng = random.Random(self.seed * 7919 + 3)
        self.collectives = Collectives(self, rounds_kind(self.plant))
        self.kv = KvSim(self, self.plant)
        # With standbys: the election, and what reached the leader while it was stopped.
        self.ha = Standbys(self, self.schedulers, self.plant) if self.schedulers > 1 else None
        self.held_calls: list[Packet] = []
        self.cores = Cores(self) if self.worker_cores else None
        self.finishes = Finishes(self, enabled=self.collective_steps and self.finishing)
        self.full = False  # the disk is full: every save fails until it is freed
        self.wiped: int | None = None  # the rank whose checkpoint files were lost (`disks`)
        self.disk_rng = random.Random(self.seed * 104729 + 1)  # disk faults: their own stream
        # Incarnations, 63 random bits per process as `cluster.worker.identity` draws them: their
        # own stream too. The newest report number heard of each (node id, incarnation).
        self.incarnation_rng = random.Random(self.seed * 15485863 + 2)
        self.reports_heard: dict[tuple[str, int], int] = {}
        if self.ha is not None:
            self.ha.start()
        self.carry_out(self.outbox.advance(self.state.revision))

    # -- the scheduler: its machine, its outbox, its disk -------------------------------------

    def violation(self, invariant: str, message: str) -> Violation:
        return Violation(invariant, message)

    def note(self, line: str) -> None:
        """A line of what happened, for a transcript."""
        if self.log is not None:
            self.log.append(f"{self.clock.now - START_S:.1f}s {line}")

    def _outbox(self, saved: int) -> Outbox:
        return outbox_kind(self.plant)(write_ahead=True, saved=saved, recovery=True)

    def step_machine(self, effects: list[Effect]) -> None:
        self.carry_out(self.outbox.step(self.state.revision, effects))

    def carry_out(self, ready: Ready) -> None:
        saved = int(self.stored["revision"])
        for tell in ready.tell:
            if tell.revision > saved:
                raise Violation(
                    "write-ahead",
                    f"told revision {tell.revision} with {saved} saved: {tell.effect}",
                )
            if tell.effect is None:  # only rounds to fail (a rank finished)
                self.collectives.told(tell)
                continue
            self.told += 1
            self.note(describe(tell.effect))
            self.check_told(tell)
            self.collectives.told(tell)  # before the event, as the engine's `_tell`
            self.send_tell(tell)

    def check_told(self, tell: Tell) -> None:
        job, effect = self.state.cluster_id, tell.effect
        if isinstance(effect, NodeFailedEvent):
            key = (job, effect.node_id, effect.rank, effect.generation)
            if key in self.failures_told:
                raise Violation("failure-once", f"failure told twice: {effect}")
            self.failures_told.add(key)
            self.failed_in[job] = effect.generation
        self.finishes.check_told(job, effect)
        if isinstance(effect, TopologyReadyEvent):
            self.check_rollback(effect, effect.peers)
            putback.check_lineage(self, effect)
            putback.told(self, effect)
            self.check_handover(effect)
            self.generation_told[job] = max(self.generation_told.get(job, 0), effect.generation)
            self.progress = effect.rollback_step  # the group goes on from there

    def send_tell(self, tell: Tell) -> None:
        effect = tell.effect
        if isinstance(effect, Evict):
            stream = self.streams.pop((effect.node_id, effect.incarnation), None)
            if stream is not None:
                body = ("evict", effect.incarnation, stream)
                self.net.send(self.clock.now, SCHED, effect.node_id, body, stream=True)
            return
        if not isinstance(effect, TopologyReadyEvent | NodeFailedEvent | ShutdownEvent):
            return  # progress counts go with the registration's answer here
        if not isinstance(effect, NodeFailedEvent):
            self.catch_up = [effect]
        for (node_id, incarnation), stream in sorted(self.streams.items()):
            body = ("event", incarnation, effect, stream)
            self.net.send(self.clock.now, SCHED, node_id, body, stream=True)

    def check_rollback(self, ready: TopologyReadyEvent, peers: Any) -> None:
        """The step a generation rolls back to is on disk for every rank in `peers`; a rank
        whose files were lost with its disk fetches it from a peer of the generation that
        holds it (state from peers)."""
        if ready.rollback_step == 0:
            return
        step = ready.rollback_step
        for peer in peers:
            held = self.files.get(peer.rank, set())
            from_peer = peer.rank == self.wiped and any(
                step in self.files.get(p.rank, set()) for p in ready.peers if p.rank != peer.rank
            )
            if step not in held and not from_peer:
                raise Violation(
                    "rollback",
                    f"generation {ready.generation} rolls back to step {ready.rollback_step}, "
                    f"which rank {peer.rank} ({peer.node_id}) does not hold ({sorted(held)})",
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
                    "one-holder",
                    f"generation {ready.generation} gives rank {peer.rank} to {peer.node_id}, "
                    f"but the failure of its holder {holder} was never told",
                )
        self.peers_told[job] = {p.rank: p.node_id for p in ready.peers}

    def save_pending(self) -> bool:
        return self.outbox.requested > int(self.stored["revision"])

    def save_lands(self) -> None:
        """The saver's pending save lands (unless the disk is full, or with standbys, the
        leader's lease no longer fences it in)."""
        if self.full or (self.ha is not None and not self.ha.may_save()):
            return
        self.kv.save_lands()  # the saver's round: the key-value sets, then the state
        if self.outbox.requested > int(self.stored["revision"]):
            self.previous, self.stored = self.stored, self.state.snapshot()  # the newest
            self.note(f"saved: revision {self.stored['revision']}")
            self.carry_out(self.outbox.advance(int(self.stored["revision"])))
            self.answer_saved()
            self.finishes.answer_saved()
            self.open_saved()

    def answer_saved(self) -> None:
        """Send the answers whose revision is saved (`answers`: revision, node, answer)."""
        saved = int(self.stored["revision"])
        ready = [a for a in self.answers if a[0] <= saved]
        self.answers = [a for a in self.answers if a[0] > saved]
        for _, node_id, answer in ready:
            self.net.send(self.clock.now, SCHED, node_id, answer)

    def crash_answering(self) -> None:
        """The crash point fired (`Collectives.crash_point`): from now on the workers hold,
        the answers sent arrive, and the scheduler dies before it sends the others and comes
        back. The other faults stop here, so that only the restarted scheduler can free the
        ranks left in the round."""
        self.trace.append(self.crash_after)
        self.crash_after = ""
        self.holding = True
        self.time_passes(5.0)  # past the slowest stream packet
        self.restart_scheduler()

    def restart_scheduler(self) -> None:
        """The scheduler dies and comes back on what the disk holds; every connection to it
        breaks, and the processes register again."""
        self.drop_machine()
        self.restore_machine("")

    def drop_machine(self) -> None:
        """The scheduler that ran the job's machine died or stepped down: its rounds, its
        answers not sent and every connection to it are gone."""
        self.collectives.restart()
        self.finishes.restart()
        self.answers = []  # their calls fail with the scheduler
        self.opening = []
        self.held_calls = []
        self.streams.clear()
        self.net.drop_scheduler()
        for proc in self.processes.values():
            if proc.stopped:  # it reads what its dead connection held, then the end of it
                proc.inbox.append(
                    Packet(self.clock.now, 0, SCHED, proc.node_id, ("unknown", proc.incarnation))
                )
            elif self.cores is not None and proc.running and proc.member:
                self.cores.lost(proc, "the scheduler's connection broke", cut=True)
            proc.member = False

    def restore_machine(self, why: str) -> None:
        """A scheduler loads the job from what the disk (or etcd) holds and serves it."""
        self.restarts += 1
        if why:
            self.note(f"{why}: on revision {self.stored['revision']}")
        if self.plant == "stale-disk":
            self.stored = self.previous
        restored = state_kind(self.plant).restore(
            self.stored, self.settings, self.clock, new_cluster_id=f"job-{self.restarts}"
        )
        self.state = planted(restored, self.plant)
        self.kv.restart()
        self.outbox = self._outbox(int(self.stored["revision"]))
        self.catch_up = self.state.catch_up()
        for node_id in self.heard:
            self.heard[node_id] = self.clock.now  # the restored guard counts from now
        self.finishes.check_restored()
        told = self.generation_told.get(self.state.cluster_id, 0)
        if self.state.phase is Phase.READY and self.state.generation < told:
            raise Violation(
                "generations",
                f"restarted at generation {self.state.generation}, a node was told {told}",
            )

    # -- the scheduler hears a worker ---------------------------------------------------------

    def serving(self) -> bool:
        return self.ha is None or self.ha.serving()

    def to_scheduler(self, packet: Packet) -> None:
        """A worker's call or stream message reaches the job's scheduler (with standbys: the
        leader's process, which holds it while stopped; a scheduler that does not serve answers
        the call with "not the leader", and the worker registers again)."""
        if self.ha is not None and not self.ha.serving():
            leader = self.ha.scheds.get(self.ha.leader or "")
            if leader is not None and leader.running and leader.stopped:
                self.held_calls.append(packet)
            elif packet.body[0] == "register" and len(packet.body) > 2:  # a core's attempt
                answer = ("answer", packet.body[1].incarnation, None, packet.body[2], 0)
                self.net.send(self.clock.now, SCHED, packet.src, answer)
            elif packet.body[0] == "finish":  # a standby's NotLeader: UNAVAILABLE
                refused = ("finish-answer", *packet.body[1:3], "UNAVAILABLE", "not the leader")
                self.finishes.answer(packet.src, refused)
            elif packet.body[0] not in ("register", "closed"):
                self.net.send(self.clock.now, SCHED, packet.src, ("unknown", packet.body[1]))
            return
        kind, node_id = packet.body[0], packet.src
        if kind == "register":
            self.on_register(packet.body[1], *packet.body[2:])
            return
        incarnation = packet.body[1]
        try:
            if kind == "beat":
                self.state.heartbeat(node_id, incarnation)
                self.heard[node_id] = self.clock.now
            elif kind == "report":
                self.state.report_checkpoints(node_id, incarnation, *packet.body[2:])
                self.check_report_taken(node_id, incarnation, packet.body[2], packet.body[4])
                held = self.state.held_by_all()
                self.step_machine([])  # saves the holdings
                # As the engine: answered once the holdings it was computed from are saved.
                reply = ("held", incarnation, held, packet.body[4])
                self.answers.append((self.state.revision, node_id, reply))
                self.answer_saved()
            elif kind == "kv":
                self.kv.on_call(node_id, incarnation, packet.body[2])
            elif kind == "exchange":
                self.collectives.on_exchange(node_id, incarnation, *packet.body[2:])
            elif kind == "finish":
                self.finishes.on_finish(node_id, incarnation, packet.body[2])
            elif kind == "closed":
                if self.streams.get((node_id, incarnation)) != packet.body[2]:
                    return  # an older stream of the node (an attempt it gave up on) ended
                del self.streams[(node_id, incarnation)]
                self.collectives.abandoned(node_id, incarnation)
                self.step_machine(self.state.disconnect(node_id, incarnation))
        except UnknownNodeError:
            self.net.send(self.clock.now, SCHED, node_id, ("unknown", incarnation))

    def on_register(self, reg: Registration, attempt: int = 0) -> None:
        """A registration opens the node's stream (as `Watch` with a `RegisterRequest` does):
        accepted, the answer and then what the node must hear first go on that stream."""
        if self.cores is not None and attempt:
            self.cores.reached(reg.node_id, attempt)
        known = self.state.find(reg.node_id)
        before = None if known is None else known.incarnation
        outcome, effects = self.state.register(reg)
        now, node_id = self.clock.now, reg.node_id
        if isinstance(outcome, Refused):
            self.net.send(now, SCHED, node_id, ("answer", reg.incarnation, outcome, attempt, 0))
            return
        self.check_guard(reg, before)
        self.heard[node_id] = now
        self.step_machine(effects)
        self.collectives.registered(reg)
        # As the engine: answered once the registration's revision is saved
        # (`_durable_keeping_alive`); then its stream opens (`watch`: connect, the catch-up).
        self.opening.append((self.state.revision, reg, outcome, attempt))
        self.open_saved()

    def open_saved(self) -> None:
        """Answer the registrations whose revision is saved, and open their streams."""
        saved = int(self.stored["revision"])
        ready = [o for o in self.opening if o[0] <= saved]
        self.opening = [o for o in self.opening if o[0] > saved]
        for _, reg, outcome, attempt in ready:
            self.open_stream(reg, outcome, attempt)

    def open_stream(self, reg: Registration, outcome: Accepted, attempt: int) -> None:
        now, node_id = self.clock.now, reg.node_id
        try:
            self.state.connect(node_id, reg.incarnation)
        except (UnknownNodeError, EvictedError):  # failed or replaced while being saved
            self.net.send(now, SCHED, node_id, ("unknown", reg.incarnation))
            return
        old = self.streams.get((node_id, reg.incarnation))
        if old is not None and self.plant != "silent-supersede":  # it ends (`Streams.open`)
            self.net.send(now, SCHED, node_id, ("superseded", reg.incarnation, old), stream=True)
        stream = self.streams[(node_id, reg.incarnation)] = next(self.stream_numbers)
        answer = ("answer", reg.incarnation, outcome, attempt, stream)
        self.net.send(now, SCHED, node_id, answer, stream=True)
        for event in self.state.catch_up_for(node_id, self.catch_up):  # as `watch` does
            body = ("event", reg.incarnation, event, stream)
            self.net.send(now, SCHED, node_id, body, stream=True)

    def check_report_taken(
        self, node_id: str, incarnation: int, steps: list[int], seq: int
    ) -> None:
        """A report of the member's current process, newer than any of that process heard, is
        what the scheduler holds for the member now (an older one, overtaken on the network,
        may be ignored)."""
        key = (node_id, incarnation)
        if seq <= self.reports_heard.get(key, 0):
            return
        self.reports_heard[key] = seq
        member = self.state.find(node_id)
        if member is not None and member.checkpoints != tuple(sorted(set(steps))):
            raise Violation(
                "report-taken",
                f"report {seq} of node {node_id} incarnation {incarnation} said {sorted(steps)}; "
                f"the scheduler holds {list(member.checkpoints)}",
            )

    def check_guard(self, reg: Registration, before: int | None) -> None:
        """A new process of a known node id is taken only after MS_NODE_TIMEOUT of silence."""
        silent = self.clock.now - self.heard.get(reg.node_id, float("-inf"))
        if before not in (None, reg.incarnation) and silent < self.node_timeout_s:
            raise Violation(
                "guard",
                f"node {reg.node_id} incarnation {reg.incarnation} was accepted {silent:g} s "
                f"after incarnation {before} was last heard (guard {self.node_timeout_s:g} s)",
            )

    # -- the workers ----------------------------------------------------------------------------

    def registration(self, proc: Process, job: str | None = None) -> Registration:
        answered = self.collectives.last_answered.get(proc.node_id, (0, 0))
        return Registration(
            node_id=proc.node_id,
            role=NodeRole.WORKER,
            host="h0",
            port=proc.port,
            incarnation=proc.incarnation,
            worker_num=self.workers,
            server_num=0,
            cluster_id=proc.job if job is None else job,
            protocol_revision=version.PROTOCOL_REVISION,
            credential_digest=auth.credential_digest(f"{proc.node_id}:{proc.incarnation}".encode()),
            spare=proc.spare,
            collectives_generation=answered[0],
            collectives_answered=answered[1],
        )

    def send(self, proc: Process, body: tuple[Any, ...]) -> None:
        self.net.send(self.clock.now, proc.node_id, SCHED, body)

    def send_on_stream(self, proc: Process, body: tuple[Any, ...]) -> None:
        """A call on `proc`'s connection: in order, lost only with the connection."""
        self.net.send(self.clock.now, proc.node_id, SCHED, body, stream=True)

    def to_worker(self, proc: Process, packet: Packet) -> None:
        if not proc.running:
            return
        if proc.stopped:
            proc.inbox.append(packet)
            return
        kind, incarnation = packet.body[0], packet.body[1]
        if incarnation != proc.incarnation:
            return  # meant for an earlier process of this node id
        if self.cores is not None and kind in ("answer", "event", "evict", "unknown", "superseded"):
            self.to_core(proc, kind, packet.body)
        elif kind == "answer":
            self.on_answer(proc, packet.body[2])
        elif kind == "event":
            self.on_event(proc, packet.body[2])
        elif kind == "xanswer":
            self.collectives.on_answer(proc, *packet.body[2:])
        elif kind == "kvanswer":
            self.kv.on_answer(proc, *packet.body[2:])
        elif kind == "held" and proc.rank is not None:
            self.keep_from[proc.rank] = max(self.keep_from.get(proc.rank, 0), packet.body[2])
            putback.answered(proc, packet.body[3])
        elif kind == "finish-answer" and self.cores is not None:
            self.finishes.on_core_answer(proc, *packet.body[2:])
        elif kind == "finish-answer":
            self.finishes.on_simple_answer(proc, *packet.body[3:])
        elif kind in ("evict", "unknown"):
            proc.member = False  # cut off: it registers again

    def to_core(self, proc: Process, kind: str, body: tuple[Any, ...]) -> None:
        assert self.cores is not None
        if kind == "answer":
            self.cores.answer(proc, body[2], body[3], body[4])
        elif kind in ("event", "evict", "superseded"):  # on a stream: the one it reads?
            if self.cores.streams.get(proc.node_id) != body[-1]:
                return
            if kind == "event":
                self.cores.event(proc, body[2])
            else:  # evicted, or a newer stream of the node replaced this one
                self.cores.lost(proc, "the scheduler closed the event stream")
        else:  # the scheduler does not know it (any more)
            self.cores.lost(proc, "the scheduler closed the event stream")

    def on_answer(self, proc: Process, outcome: Accepted | Refused) -> None:
        if isinstance(outcome, Refused) or not proc.member:
            self.note(f"{proc.node_id} hears: {describe(outcome)}")
        if isinstance(outcome, Refused):
            if not outcome.reason.transient:
                proc.running, proc.ended = False, outcome.reason.value  # it exits, told why
            return
        if proc.member:
            return  # a duplicate answer
        if outcome.cluster_id != proc.job:
            proc.job, proc.rank, proc.paused = outcome.cluster_id, None, False
        proc.member = True
        self.collectives.send(proc)  # the calls it waits on, made again (a new scheduler)
        self.kv.send(proc)
        self.finishes.send(proc)

    def on_event(self, proc: Process, event: Effect) -> None:
        if isinstance(event, ShutdownEvent):
            proc.running, proc.member, proc.ended = False, False, "shutdown"
            return
        if isinstance(event, NodeFailedEvent):
            proc.paused = True
            return
        if isinstance(event, TopologyReadyEvent):
            self.delivered(proc, event)

    def delivered(self, proc: Process, event: TopologyReadyEvent) -> None:
        """The process takes the topology `event` says (its rank, or none: a spare)."""
        seen = proc.generations.setdefault(proc.job, [])
        if seen and event.generation <= seen[-1]:
            if event.generation == seen[-1]:
                return  # the catch-up of a generation it heard (a reconnect)
            raise Violation(
                "generations", f"node {proc.node_id} heard {event.generation} after {seen}"
            )
        seen.append(event.generation)
        mine = [p for p in event.peers if p.node_id == proc.node_id]
        if event.generation >= self.generation_told.get(proc.job, 0):
            # A generation heard after a newer one was told is never put back: its first
            # collective fails (the newer one's step is checked when that is heard).
            self.check_rollback(event, mine)
        proc.rank = mine[0].rank if mine else None
        proc.paused = False
        putback.heard(self, proc, event)

    def new_incarnation(self, proc: Process) -> int:
        """The incarnation of `proc`'s next process: random, unordered, as a real one's."""
        return self.incarnation_rng.randrange(1, 2**63)

    def start(self, proc: Process) -> None:
        if not proc.running:
            proc.running, proc.incarnation, proc.ended = True, self.new_incarnation(proc), ""
            proc.reports, proc.put_back = 0, {}
            proc.restoring, proc.committed, proc.writing = None, None, None
            proc.awaiting, proc.step = None, 0
            proc.last_report, proc.answered_report = None, 0
            proc.past_end, proc.finishing = False, False
            proc.member, proc.stopped, proc.inbox, proc.rank = False, False, [], None
            self.collectives.forget(proc)
            self.kv.forget(proc)
            self.finishes.forget(proc)
            if self.cores is not None:
                self.cores.start(proc)
            else:
                self.send(proc, ("register", self.registration(proc)))

    def kill(self, proc: Process) -> None:
        """The process dies; its stream breaks, which the scheduler sees unless the link is
        cut (then only its silence tells)."""
        if proc.running:
            proc.running = False
            self.finishes.forget(proc)
            self.net.break_stream(proc.node_id)
            # Only a stream the scheduler has open breaks (a restart ended the others).
            stream = self.streams.get((proc.node_id, proc.incarnation))
            if proc.node_id not in self.net.cut and stream is not None:
                body = ("closed", proc.incarnation, stream)
                self.net.send(self.clock.now, proc.node_id, SCHED, body, stream=True)

    def train(self, proc: Process) -> None:
        """The process trained on and saved a checkpoint of its rank; the rank keeps its newest
        three and every step from the one all workers hold (as a `CheckpointManager` prunes),
        and reports them; the scheduler's answer is the step every worker holds. Each step
        ends in a collective (a barrier or an allgather: `collectives`). A process that heard
        a new generation puts its rollback step back first (`putback`)."""
        if not proc.running or proc.stopped or not proc.member or proc.paused or proc.rank is None:
            return
        if proc.past_end:
            return  # its loop is over
        self.collectives.call(proc)
        if not self.in_newest(proc):
            return  # its group moved on, or a peer failed: the data plane waits
        putback.train(self, proc)

    def in_newest(self, proc: Process) -> bool:
        """Whether `proc` is in its job's newest generation told, and no peer failed in it."""
        newest = self.generation_told.get(proc.job, 0)
        return (
            proc.generations.get(proc.job, [0])[-1] == newest
            and self.failed_in.get(proc.job) != newest
        )

    def beat(self) -> None:
        """Every running process beats, or asks again to register."""
        for proc in self.processes.values():
            if proc.running and not proc.stopped:
                if proc.member:
                    self.send(proc, ("beat", proc.incarnation))
                    putback.again(self, proc)
                    if self.collective_steps and not proc.past_end:
                        putback.beat(self, proc)  # its writer, its loop
                    if self.collective_steps:
                        self.collectives.call(proc)  # a step a second, each ends in a collective
                elif self.cores is None:  # a core registers on its own timers
                    self.send(proc, ("register", self.registration(proc)))
                self.finishes.beat(proc)  # past its end: it calls finalize() at times
        if self.ha is not None:
            self.ha.beat()
            if self.ha.leader is None or self.ha.scheds[self.ha.leader].stopped:
                return
        self.keep_waiting_alive()
        self.step_machine(self.state.tick())

    def keep_waiting_alive(self) -> None:
        """As `_durable_keeping_alive`: a registration waiting for its save is its node's sign
        of life, while its call lasts (its process runs; a core has not given the attempt up)."""
        for _, reg, _, attempt in self.opening:
            proc = self.processes[reg.node_id]
            if not proc.running or proc.incarnation != reg.incarnation:
                continue
            if self.cores is not None and self.cores.attempts.get(reg.node_id) != attempt:
                continue
            with contextlib.suppress(UnknownNodeError):
                self.state.heartbeat(reg.node_id, reg.incarnation)
                self.heard[reg.node_id] = self.clock.now

    def leader_continues(self) -> None:
        """The leader's process continued (SIGCONT): the calls it held are read now."""
        held, self.held_calls = self.held_calls, []
        for packet in held:
            self.to_scheduler(packet)

    def continue_(self, proc: Process) -> None:
        proc.stopped = False
        inbox, proc.inbox = proc.inbox, []
        for packet in inbox:
            self.to_worker(proc, packet)

    def time_passes(self, seconds: float) -> None:
        end = self.clock.now + seconds
        while True:
            timers = self.cores.next_at() if self.cores is not None else float("inf")
            at = min(self.net.next_at(), self.next_beat, timers)
            if at > end:
                break
            self.clock.now = max(self.clock.now, at)
            packet = self.net.due(self.clock.now)
            if packet is None and self.cores is not None and timers <= self.clock.now:
                self.cores.fire()
            elif packet is not None:
                if packet.dst == SCHED:
                    self.to_scheduler(packet)
                elif packet.dst == ETCD and self.ha is not None:
                    self.ha.to_etcd(packet)
                elif self.ha is not None and packet.dst in self.ha.scheds:
                    self.ha.to_scheduler(self.ha.scheds[packet.dst], packet)
                else:
                    self.to_worker(self.processes[packet.dst], packet)
            elif self.next_beat <= self.clock.now:
                self.next_beat += HEARTBEAT_S
                self.beat()
        self.clock.now = end

    # -- checks ----------------------------------------------------------------------------------

    def check(self) -> None:
        if self.ha is not None:
            self.ha.check_one_leader()
        holders: dict[int, str] = {}
        for member in self.state.members.values():
            if member.state is NodeState.ALIVE and member.rank is not None:
                if member.rank in holders:
                    raise Violation(
                        "one-holder",
                        f"rank {member.rank}: {holders[member.rank]} and {member.node_id}",
                    )
                holders[member.rank] = member.node_id
        for proc in self.processes.values():
            for job, seen in proc.generations.items():
                if any(b <= a for a, b in itertools.pairwise(seen)):
                    raise Violation("generations", f"node {proc.node_id} heard {seen} of {job}")

    # -- one schedule ----------------------------------------------------------------------------

    def choose(self) -> tuple[str, Any]:  # noqa: PLR0911 - one return per kind of step
        roll = self.rng.random()
        proc = self.rng.choice(list(self.processes.values()))
        name = proc.node_id
        if roll < 0.12:
            return f"start {name}", lambda: self.start(proc)
        if roll < 0.27:
            return f"train {name}", lambda: self.train(proc)
        if roll < 0.33:
            if may_lose_disk(self, proc):
                return f"kill {name} with its disk", lambda: kill_with_disk(self, proc)
            return f"kill {name}", lambda: self.kill(proc)
        if roll < 0.36:
            return f"stop {name}", lambda: setattr(proc, "stopped", proc.running)
        if roll < 0.39:
            return f"continue {name}", lambda: self.continue_(proc)
        if roll < 0.42:
            return f"partition {name}", lambda: self.net.partition(name)
        if roll < 0.46:
            return f"heal {name}", lambda: self.net.heal(name, self.clock.now)
        if roll < 0.64:
            seconds = self.rng.choice([0.5, 2.0, 11.0])
            return f"tick {seconds:g}s", lambda: self.time_passes(seconds)
        if roll < 0.70:
            write, whose = self.rng.random() < 0.5, self.rng.choice(list(self.processes))
            what = "set" if write else f"get k{whose}"
            return f"kv {name} {what}", lambda: self.kv.call(proc, write, whose)
        if roll < 0.93:
            return "save lands", self.save_lands
        if roll < 0.97:
            return self.disk_fault()
        if self.ha is not None:
            return self.ha.fault()
        return "scheduler restarts", self.restart_scheduler

    def disk_fault(self) -> tuple[str, Any]:
        """A save fails (it is tried again later: saves are slow by the steps between), or the
        disk fills (every save fails until it is freed), or it is freed; from the disk's own
        stream, so that the schedule's other steps stay as they are."""
        roll = self.disk_rng.random()
        if roll < 0.6:
            return "save fails", lambda: None
        if roll < 0.8:
            return "disk fills", lambda: setattr(self, "full", True)
        return "disk freed", lambda: setattr(self, "full", False)

    def settled(self) -> bool:  # noqa: PLR0911 - one return per way it is (not) settled
        """The job is over and every process was told (`job-end`: ended well once every rank
        finished); or, where the workers hold (call no collective, so that none reaches its
        end barrier) or the run has no end, it formed with every process in it at its newest
        generation, but for the ranks that finished; nothing waits for a save."""
        if self.outbox.waiting or self.outbox.requested > int(self.stored["revision"]):
            return False
        procs = self.processes.values()
        if self.state.phase in (Phase.FINISHED, Phase.FAILED):
            self.finishes.check_settled(0.0)
            return all(not p.running for p in procs)
        if not self.serving() or self.state.phase is not Phase.READY:
            return False
        if self.finishes.enabled and not self.holding:
            return False  # the workers train on to the end, and finish
        collectives = self.collectives
        if (
            not all(p.member or p.ended for p in procs)
            or self.kv.batch
            or collectives.stuck()
            or collectives.cut_waiting()
        ):
            return False
        generation = self.state.generation
        for member in self.state.members.values():
            proc = self.processes[member.node_id]
            heard = proc.generations.get(proc.job, [0])
            if member.state is NodeState.FINISHED and not proc.running:
                continue
            if member.state is not NodeState.ALIVE or not proc.member or heard[-1] != generation:
                return False
        return True

    def heal(self, bound_s: float = LIVENESS_BOUND_S) -> None:
        """Faults stop: links heal, stopped processes continue, dead ones start again (unless
        told to go), saves land, time passes; within `bound_s` of virtual time the job must
        settle (`settled`). A crash point that fires meanwhile (a round completes as the job
        settles) kills the scheduler as in the schedule's steps (`crash_answering`)."""
        self.net.calm(self.clock.now)
        self.full = False
        start = self.clock.now
        while self.clock.now - start < bound_s:
            if self.ha is not None:
                self.ha.heal()
            for proc in self.processes.values():
                if proc.stopped:
                    self.continue_(proc)
                if not proc.running and not proc.ended:
                    self.start(proc)
            self.save_lands()
            if self.settled():
                return
            self.time_passes(2.0)
            self.check()
            if self.crash_after:  # the crash point fired as the job settled: it dies now
                self.crash_answering()
            self.finishes.end_fault()  # Finishes meet faults too
        self.finishes.check_settled(bound_s)
        waiting = self.collectives.stuck() + self.collectives.cut_waiting()
        raise Violation(
            "liveness",
            f"the job did not settle within {bound_s:g} s of virtual time after the faults"
            + "".join(f"; {line}" for line in waiting),
        )

    def run(self, steps: int) -> None:
        for proc in self.processes.values():
            self.start(proc)
        crashes = self.seed % 3 == 2 and self.ha is None
        armed_at = self.crash_rng.randrange(steps) if crashes else steps
        self.finishes.arm(steps)
        for step in range(steps):
            self.collectives.crash_point |= step == armed_at
            if step == self.finishes.decide_at:
                self.finishes.decide()
            name, act = self.choose()
            self.trace.append(name)
            act()
            self.check()
            if self.crash_after:
                self.crash_answering()
                break
        self.trace.append("faults stop")
        self.finishes.decide()
        self.holding = self.seed % 3 == 2
        self.heal()


def run_seed(  # noqa: PLR0913 - the options of a schedule
    seed: int,
    steps: int = 200,
    workers: int = 3,
    plant: str = "",
    spares: int = 1,
    schedulers: int = 1,
    worker_cores: bool = False,
    *,
    finishing: bool = True,
) -> Sim:
    """One schedule; raises `Violation` (with `sim` set to the run) when an invariant breaks.
    A plant of the election runs with standbys. `finishing` False: the workers never reach an
    end (the schedules before Finish was simulated, kept for the seeds that found bugs)."""
    schedulers = max(schedulers, PLANT_SCHEDULERS.get(plant, 1))
    worker_cores = worker_cores or plant in PLANT_CORES
    sim = Sim(seed, workers, plant, spares, schedulers, worker_cores, finishing=finishing)
    try:
        sim.run(steps)
    except Violation as exc:
        exc.sim = sim  # type: ignore[attr-defined]
        raise
    return sim


__all__ = [
    "PLANTS",
    "PLANT_CORES",
    "PLANT_SCHEDULERS",
    "PLANT_SPARES",
    "EarlyRelease",
    "Sim",
    "Violation",
    "run_seed",
]
