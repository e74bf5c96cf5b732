"""The collectives in the simulation: the scheduler's real round table (`machine.rounds.Rounds`)
driven as the engine drives it (`cluster.scheduler.exchange`, `SchedulerCore.exchange`), and
workers that call a barrier or an allgather at each training step.

A collective call goes on the node's connection (in order; lost when the scheduler dies, then
made again, with the same generation, number and bytes, once the node is back in): the
scheduler admits it (`admit_exchange`), re-forms the job when a restart cut a round in two
(`cut_off`), joins it to its round, and answers every caller when the round completes or fails.
A worker whose call fails waits for a newer generation before it calls again.

Invariants (`Violation.invariant`):

- `rounds-complete`: a round completes with exactly one contribution per rank, each from the
  node that holds that rank in the round's generation; every rank gets the same answer;
- `rounds-fail`: once a new generation or a failure is told, no round of an older generation
  is open (none can complete with what the new generation sends), and no worker of the newest
  generation is left waiting on one when the job settles;
- `liveness` (the job settles after the faults): no worker is left waiting on a round another
  rank got the answer of (a scheduler that died answering it, to some ranks only: every third
  schedule of one scheduler makes that moment, `crash_point`), in the schedules whose workers
  hold from then on (call no new collective, so that nobody calls past that round: its
  successor learns of it from the registrations, `registered`; plant `deaf-rounds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.protocol import auth
from cluster.protocol.errors import ClusterError, CollectiveError, PeerFailedError
from cluster.protocol.records import NodeFailedEvent, Registration, TopologyReadyEvent
from cluster.scheduler.machine.admission import ALLGATHER, BARRIER, Denied
from cluster.scheduler.machine.ready import Tell
from cluster.scheduler.machine.rounds import Completed, Failed, Joined, Round, Rounds

if TYPE_CHECKING:
    from tests.sim.control_plane import Process, Sim

ROUND_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Call:
    """A collective a worker called and waits on."""

    job: str
    generation: int
    seq: int
    op: str

    def value(self, node_id: str) -> bytes:
        return b"" if self.op == BARRIER else f"{node_id}:{self.generation}:{self.seq}".encode()


@dataclass
class Waiter:
    node_id: str
    incarnation: int
    rank: int
    call: Call


@dataclass
class Collectives:
    """The scheduler's rounds and the workers' calls."""

    sim: Sim
    rounds_kind: type[Rounds] = Rounds  # a plant's (`deaf-rounds`) in its place
    rounds: Rounds = field(init=False)
    waiters: dict[Round, list[Waiter]] = field(default_factory=dict)
    # What each worker waits on, by node id; the numbers each used, per (job, generation); the
    # generation a failed call left it waiting past, per node id and job.
    calls: dict[str, Call] = field(default_factory=dict)
    numbers: dict[tuple[str, str, int], int] = field(default_factory=dict)
    failed_at: dict[tuple[str, str], int] = field(default_factory=dict)
    # The peers of each generation told, per (job, generation); the answer of each round heard.
    peers: dict[tuple[str, int], dict[int, str]] = field(default_factory=dict)
    answers: dict[tuple[str, int, int], list[bytes]] = field(default_factory=dict)
    # The last call each node's process got answered, (generation, number): said when it
    # registers, as the worker core keeps it (per process: a new one starts from nothing).
    last_answered: dict[str, tuple[int, int]] = field(default_factory=dict)
    completed: int = 0
    cut_at_registration: int = 0

    # Armed: the next round to complete is answered to some of its callers only, and the
    # scheduler dies (`Sim.crash_after`).
    crash_point: bool = False

    def __post_init__(self) -> None:
        self.rounds = self.rounds_kind(timeout_s=ROUND_TIMEOUT_S)

    # -- a worker ------------------------------------------------------------------------------

    def call(self, proc: Process) -> None:
        """`proc` calls its step's collective, unless it waits on one or for a new generation,
        or the workers hold (`Sim.holding`: a long step, or the end of the job)."""
        if self.sim.holding:
            return
        waiting = self.calls.get(proc.node_id)
        if waiting is not None and waiting.job == proc.job:
            return
        if not proc.member or proc.paused or proc.rank is None:
            return
        heard = proc.generations.get(proc.job)
        if not heard or heard[-1] <= self.failed_at.get((proc.node_id, proc.job), 0):
            return
        key = (proc.job, proc.node_id, heard[-1])
        seq = self.numbers.get(key, 0) + 1
        end = self.sim.finishes.next_call(proc, heard[-1], seq)
        if end is None:
            return  # past its end, or at its end barrier before it is ready for it
        self.numbers[key] = seq
        op = BARRIER if end or seq % 2 else ALLGATHER
        call = self.calls[proc.node_id] = Call(proc.job, heard[-1], seq, op)
        if end:
            self.sim.finishes.ends[proc.node_id] = call
        self.send(proc)

    def send(self, proc: Process) -> None:
        """`proc` (again) sends the call it waits on, if any: on its connection, in order."""
        call = self.calls.get(proc.node_id)
        if call is not None and call.job == proc.job:
            body = ("exchange", proc.incarnation, call, call.value(proc.node_id))
            self.sim.net.send(self.sim.clock.now, proc.node_id, "sched", body, stream=True)

    def forget(self, proc: Process) -> None:
        """A new process of the node id: the old one's call, and what it was answered, died
        with it."""
        self.calls.pop(proc.node_id, None)
        self.last_answered.pop(proc.node_id, None)

    def on_answer(self, proc: Process, call: Call, outcome: list[bytes] | ClusterError) -> None:
        if self.calls.get(proc.node_id) != call:
            return  # an answer to a call it no longer waits on (a retry's twin)
        del self.calls[proc.node_id]
        self.sim.finishes.answered(proc, call, outcome)
        if isinstance(outcome, ClusterError):
            self.failed_at[(proc.node_id, call.job)] = call.generation
            return
        known = self.last_answered.get(proc.node_id, (0, 0))
        self.last_answered[proc.node_id] = max(known, (call.generation, call.seq))
        key = (call.job, call.generation, call.seq)
        first = self.answers.setdefault(key, outcome)
        if first != outcome:
            raise self.sim.violation(
                "rounds-complete",
                f"{proc.node_id} got {outcome} from collective {key[1:]}, another rank {first}",
            )

    # -- the scheduler -------------------------------------------------------------------------

    def on_exchange(self, node_id: str, incarnation: int, call: Call, value: bytes) -> None:
        """As `SchedulerCore.exchange`: admit, re-form a cut round, join, answer."""
        sim, st = self.sim, self.sim.state
        proc = sim.processes[node_id]
        presented = auth.Presented(digest=sim.registration(proc).credential_digest)
        if proc.incarnation != incarnation or call.job != st.cluster_id:
            return  # a dead process's call; a call meant for another job's scheduler
        ticket = st.admission.admit_exchange(
            node_id, presented, generation=call.generation, op=call.op, root=0
        )
        if isinstance(ticket, Denied):
            self.answer(node_id, incarnation, call, ticket.error())
            return
        if st.restored_generation == call.generation and self.rounds.cut_off(
            call.generation, call.seq, ticket.rank
        ):
            reason = f"collective #{call.seq} of generation {call.generation} was cut in two"
            sim.step_machine(st.reform(reason))
            self.answer(node_id, incarnation, call, PeerFailedError(reason))
            return
        key = (call.generation, call.seq)
        try:
            if ticket.closed:  # as `ExchangeTable.contribute`: a rank has finished
                again = self.rounds.made_again(
                    key, rank=ticket.rank, op=call.op, root=0, value=value
                )
                if again is None:
                    raise CollectiveError(ticket.closed)
                joined: Joined = again
            else:
                joined = self.rounds.join(
                    key,
                    rank=ticket.rank,
                    size=ticket.size,
                    op=call.op,
                    root=0,
                    value=value,
                    now=sim.clock.now,
                )
        except ClusterError as exc:
            self.answer(node_id, incarnation, call, exc)
            return
        rnd = joined.round
        if isinstance(joined, Failed):
            self.answer(node_id, incarnation, call, joined.error)
            self.settle(rnd, joined.error)
            return
        self.waiters.setdefault(rnd, []).append(Waiter(node_id, incarnation, ticket.rank, call))
        if isinstance(joined, Completed):
            self.check_complete(rnd)
            self.completed += 1
            self.settle(rnd, rnd.answer_for(joined.gathered))

    def registered(self, reg: Registration) -> None:
        """An accepted registration said how far the node's collectives got: as the engine's
        `_answered_before`, a round open here that it was answered before is cut in two."""
        st = self.sim.state
        report = st.collectives_report(reg)
        if report is not None:
            cut = self.rounds.answered_before(*report)
            if cut is not None:
                self.cut_at_registration += 1
                reason = f"collective #{cut} of generation {report[0]} was cut in two"
                self.sim.step_machine(st.reform(reason))

    def settle(self, rnd: Round, outcome: list[bytes] | ClusterError) -> None:
        """Every caller of `rnd` gets `outcome`; at the crash point (`crash_point`), only
        some of them, and the scheduler dies before it answers the others."""
        waiters = self.waiters.pop(rnd, [])
        if self.crash_point and not isinstance(outcome, ClusterError) and len(waiters) >= 2:
            self.crash_point = False
            waiters = waiters[: self.sim.crash_rng.randrange(1, len(waiters))]
            told = ", ".join(sorted(w.node_id for w in waiters))
            self.sim.crash_after = f"the scheduler answers {told} of round {rnd.key} and dies"
        for waiter in waiters:
            self.answer(waiter.node_id, waiter.incarnation, waiter.call, outcome)
            self.rounds.answered(rnd, waiter.rank)

    def answer(
        self, node_id: str, incarnation: int, call: Call, outcome: list[bytes] | ClusterError
    ) -> None:
        body = ("xanswer", incarnation, call, outcome)
        self.sim.net.send(self.sim.clock.now, "sched", node_id, body, stream=True)

    def abandoned(self, node_id: str, incarnation: int) -> None:
        """The node's connection broke: its waiting calls are cancelled (`Rounds.abandoned`)."""
        for rnd, waiters in list(self.waiters.items()):
            gone = [w for w in waiters if (w.node_id, w.incarnation) == (node_id, incarnation)]
            for waiter in gone:
                waiters.remove(waiter)
                self.rounds.abandoned(rnd, waiter.rank)
            if not waiters:
                del self.waiters[rnd]

    def told(self, tell: Tell) -> None:
        """A tell went out: its rounds fail (`Tell.fail`), as the engine's `_tell` does."""
        job, effect = self.sim.state.cluster_id, tell.effect
        if isinstance(effect, TopologyReadyEvent):
            self.peers[(job, effect.generation)] = {p.rank: p.node_id for p in effect.peers}
        if tell.fail is not None:
            error = tell.fail.error(tell.fail.reason)
            for rnd in self.rounds.fail_all(error, keep_answer=tell.fail.keep_answer):
                self.settle(rnd, error)
        if isinstance(effect, TopologyReadyEvent | NodeFailedEvent):
            newest = effect.generation + (1 if isinstance(effect, NodeFailedEvent) else 0)
            stale = sorted(k for k, r in self.rounds.open.items() if r.open and k[0] < newest)
            if stale:
                raise self.sim.violation(
                    "rounds-fail",
                    f"{type(effect).__name__} of generation {effect.generation} was told, but "
                    f"round(s) {stale} (generation, number) of an older one are still open",
                )

    def restart(self) -> None:
        """The scheduler died: its rounds with it."""
        self.rounds = self.rounds_kind(timeout_s=ROUND_TIMEOUT_S)
        self.waiters = {}

    def check_complete(self, rnd: Round) -> None:
        """One contribution per rank, each from the node holding it in the round's generation."""
        generation, seq = rnd.key
        holders = self.peers.get((self.sim.state.cluster_id, generation), {})
        by_rank = {w.rank: w.node_id for w in self.waiters.get(rnd, [])}
        if sorted(rnd.values) != list(range(rnd.size)) or any(
            by_rank.get(r, holders.get(r)) != holders.get(r) for r in range(rnd.size)
        ):
            raise self.sim.violation(
                "rounds-complete",
                f"collective #{seq} of generation {generation} completed with ranks "
                f"{sorted(rnd.values)} from {by_rank}; generation {generation} has {holders}",
            )

    def cut_waiting(self) -> list[str]:
        """Workers that wait on a round another rank got the answer of: once the job settles,
        only a scheduler that died while answering leaves that, and its successor must re-form
        the job (the waiting worker's call fails) even when nobody calls another collective."""
        return [
            f"{node} waits on {call}, answered to another rank"
            for node, call in sorted(self.calls.items())
            if (call.job, call.generation, call.seq) in self.answers
            and self.sim.processes[node].running
        ]

    def stuck(self) -> list[str]:
        """Workers of the newest generation that wait on a call of an older one."""
        st = self.sim.state
        return [
            f"{node} waits on {call}"
            for node, call in sorted(self.calls.items())
            if call.job == st.cluster_id
            and call.generation < st.generation
            and self.sim.processes[node].running
        ]
