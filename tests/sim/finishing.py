"""The end of the job in the simulation: each rank trains to the schedule's last step, passes an
end barrier and calls `cluster.finalize()` (its Finish), amid the faults.

The end, as a `TrainingLoop` makes it (`cluster/api/training.py`): the group trains to
`end_step` (drawn per schedule from a stream of its own); every rank saves that step, waits
until it is written and its report answered (`flushed`), and passes an end barrier, one
collective of every rank with the same number on each (`end_rounds`); a rank past it calls
`finalize()` a while later (`FINALIZE_EACH_S`), and nothing more of the job. A generation that
resumed at the end (its rollback step is the last step) is opened by no allgather, and there
an end barrier refused because a peer has finished says that the others were done: the rank
finishes too. A rank's disk is not lost once a rank is past the end (its state could be
fetched from nobody).

A simple process sends its Finish on its connection (lost with the scheduler, made again once
it is back in, as its collectives are). The scheduler admits it (`Admission.admit_finish`),
applies it (`SchedulerState.finish`, failing the others' rounds as `SchedulerCore.finish`
does) and answers once its revision is saved. A worker core is stepped as the agent steps it
(`cluster/worker/agent.py`): it says `SendFinish` (a call on its way until its timeout, then
DEADLINE_EXCEEDED, and cancelled: a Finish still on the wire never reaches the scheduler),
`RetryFinish`, `HoldFinish` (woken once the node is accepted again, or the job is over); a call
fails UNAVAILABLE when its scheduler dies or a standby answers it, or with the status of a
refusal (`failures.status_of`), and its answer is `FinishAnswered`.

Invariants (`Violation.invariant`):

- `finish-counted`: a node told its Finish was heard is FINISHED in what the scheduler saved,
  unless its rank went to a spare or the saved job is over; a scheduler restarted from the
  disk knows it finished (a heard Finish is never lost to a restart);
- `job-end`: once every rank's node has had its Finish heard, the job is never told failed,
  and once the faults stop its end is told (finished) within the liveness bound;
- `finished-quiet`: the failure of a node whose Finish was heard is never told, and a worker
  core whose Finish was heard reports no failure;
- `finish-held`: a worker core whose Finish was cut off with its scheduler (UNAVAILABLE, or its
  answer late while the node lost its stream too) never exits as done without it heard: it
  holds it until the node is back, or fails saying why.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cluster.protocol import auth
from cluster.protocol.errors import CollectiveError, PeerFailedError
from cluster.protocol.records import (
    NodeFailedEvent,
    NodeState,
    Phase,
    ShutdownEvent,
    TopologyReadyEvent,
)
from cluster.scheduler.machine.admission import Denial, Denied
from cluster.scheduler.machine.ready import FailRounds
from cluster.transport import failures
from cluster.worker.machine import steps
from cluster.worker.machine.finishing import DEADLINE_EXCEEDED, FINISH_RETRIED, Sending
from cluster.worker.machine.lifecycle import Lifecycle
from tests.sim.network import SCHED

if TYPE_CHECKING:
    from tests.sim.collectives import Call
    from tests.sim.control_plane import Process, Sim

# What the trace says of the end besides the schedule's steps (`shrink` counts the steps).
NOT_STEPS = ("the scripts end at step ", "as the job ends: ")
NO_END = 10**9  # the last step, until the end is decided (transcripts: never)
FINALIZE_EACH_S = 0.5  # the chance, each second, that a rank past its end calls finalize()
# Once a rank is past the end after the faults stopped: at most this many more faults, each
# with this chance every two seconds of the job's settling (`end_fault`).
END_FAULTS = 3
END_FAULT_EACH = 0.3
FINISH_EVENTS = (steps.FinishSent, steps.FinishAnswered, steps.FinishFailed, steps.FinishRetryDue)
# What `failed_with` adds to a call's code when it timed out as the node lost its stream too.
CUT_OFF = " while reconnecting"


@dataclass
class Finishes:
    """The ranks' ends and their Finish calls (see the module docstring)."""

    sim: Sim
    enabled: bool = True
    rng: random.Random = field(init=False)
    end_step: int = NO_END
    decide_at: int = NO_END  # the schedule's step at which the end is decided
    # The number of the end barrier of each (job, generation), once a rank is ready for it;
    # the end barrier each node waits on.
    end_rounds: dict[tuple[str, int], int] = field(default_factory=dict)
    ends: dict[str, Call] = field(default_factory=dict)
    reached: bool = False  # a rank passed the end
    reached_amid: bool = False  # before the faults stopped
    generations: dict[tuple[str, int], TopologyReadyEvent] = field(default_factory=dict)
    heard: set[tuple[str, str]] = field(default_factory=set)  # (job, node) told heard
    # A simple process's answers, once their revision is saved: (revision, node, answer).
    answers: list[tuple[int, str, tuple[Any, ...]]] = field(default_factory=list)
    # A core's Finish call on its way, and its held Finish, by node: their numbers; the code
    # its last Finish call failed with.
    calls: dict[str, int] = field(default_factory=dict)
    holds: dict[str, int] = field(default_factory=dict)
    failed_with: dict[str, str] = field(default_factory=dict)
    numbers: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    # Ranks whose end barrier was refused, a peer finished, in a generation that did not resume
    # at the end: their process dies of the CollectiveError (as a TrainingLoop raises it).
    end_errors: list[str] = field(default_factory=list)
    # Finishes refused, by the refusal's kind; Finishes a core held for its scheduler.
    refused: Counter[str] = field(default_factory=Counter)
    holds_made: int = 0
    end_faults: int = 0
    cut_until: dict[str, float] = field(default_factory=dict)  # an end fault's partitions

    def __post_init__(self) -> None:
        self.rng = random.Random(self.sim.seed * 86243 + 6)

    def arm(self, steps: int) -> None:
        """Draw the step of a schedule of `steps` at which the end is decided: in its second
        half, or as the faults stop (half the schedules)."""
        if self.enabled:
            self.decide_at = self.rng.randrange(steps // 2, steps + steps // 2)

    def decide(self) -> None:
        """The last step is where the group is now, or the furthest step a rank trained to (in
        any run): as if every script ran that many steps from the start."""
        if self.end_step != NO_END or not self.enabled:
            return
        sim = self.sim
        trained = [
            *(p.step for p in sim.processes.values()),
            *map(max, filter(None, sim.files.values())),
        ]
        self.end_step = max([sim.progress, *trained])
        sim.trace.append(f"the scripts end at step {self.end_step}")

    # -- the end of training ---------------------------------------------------------------

    def ready_to_end(self, proc: Process) -> bool:
        """Whether `proc`'s loop is at its end barrier: the group trained to the last step, its
        step is put back and saved, written and reported (answered), in the newest
        generation, no peer failed."""
        sim = self.sim
        return (
            proc.rank is not None
            and not proc.past_end
            and sim.progress >= self.end_step
            and proc.step >= self.end_step
            and sim.in_newest(proc)
            and not proc.paused
            and proc.restoring is None
            and proc.committed is None
            and proc.awaiting is None
            and proc.writing is None
            and proc.answered_report >= proc.reports
        )

    def next_call(self, proc: Process, generation: int, seq: int) -> bool | None:
        """Whether `proc`'s next collective, #`seq` of `generation`, is its end barrier (True),
        an ordinary one (False), or not made now (None: it is past the end, or it waits at the
        end barrier's number until it is ready for it)."""
        if proc.past_end:
            return None
        key = (proc.job, generation)
        end = self.end_rounds.get(key)
        if end is None:
            if not self.ready_to_end(proc):
                # A generation resumed at the end makes no collective before its end barrier.
                return None if self.resumed_at_end(proc, generation) else False
            ranks = self.sim.peers_told.get(proc.job, {}).values()
            made = self.sim.collectives.numbers
            end = 1 + max((made.get((proc.job, n, generation), 0) for n in ranks), default=0)
            self.end_rounds[key] = end
        if seq < end:
            return False
        return True if seq == end and self.ready_to_end(proc) else None

    def answered(self, proc: Process, call: Call, outcome: list[bytes] | Exception) -> None:
        """`proc`'s collective `call` got `outcome`: past its end barrier, or refused there
        because a peer finished (in a generation resumed at the end: it finishes too;
        else its loop raises, and the process dies of it)."""
        if self.ends.get(proc.node_id) != call:
            return
        del self.ends[proc.node_id]
        if isinstance(outcome, PeerFailedError):
            return  # rolled back: the next generation
        if type(outcome) is CollectiveError and not self.resumed_at_end(proc, call.generation):
            self.end_errors.append(f"{proc.node_id}: {outcome}")
            self.sim.note(f"{proc.node_id} dies of {outcome}")
            self.sim.kill(proc)
            return
        proc.past_end, self.reached = True, True
        self.reached_amid |= self.sim.net.faults

    def resumed_at_end(self, proc: Process, generation: int) -> bool:
        told = self.generations.get((proc.job, generation))
        return told is not None and told.rollback_step >= self.end_step

    def beat(self, proc: Process) -> None:
        """A second of a running `proc`: past its end, it calls finalize() at times."""
        if not proc.past_end or proc.finishing or self.rng.random() >= FINALIZE_EACH_S:
            return
        proc.finishing = True
        self.sim.note(f"{proc.node_id} finalizes")
        if self.sim.cores is not None:
            self.step_core(proc, steps.FinishSent())
        else:
            self.send(proc)

    def end_fault(self) -> None:
        """As the job settles, once a rank is past the end: now and then (`END_FAULT_EACH`, up
        to `END_FAULTS`) the scheduler restarts (with standbys: the leader dies, and is started
        again two seconds later), a process past its end (or any) is cut off for longer than
        MS_NODE_TIMEOUT, or killed, so that Finishes meet the faults (most schedules reach the
        end only once theirs stopped)."""
        sim, now = self.sim, self.sim.clock.now
        for node in sorted(n for n, until in self.cut_until.items() if until <= now):
            del self.cut_until[node]
            sim.net.heal(node, now)
            sim.note(f"heal {node}")
        if not self.reached or self.end_faults >= END_FAULTS or sim.state.phase is not Phase.READY:
            return
        if self.rng.random() >= END_FAULT_EACH:
            return
        self.end_faults += 1
        running = [p for p in sim.processes.values() if p.running]
        procs = [p for p in running if p.past_end] or running
        roll, proc = self.rng.random(), self.rng.choice(procs) if procs else None
        if proc is None or roll < 0.4:
            sim.trace.append("as the job ends: the scheduler restarts")
            sim.note("as the job ends: the scheduler restarts")
            if sim.ha is not None and sim.ha.leader is not None:
                sim.ha.kill(sim.ha.scheds[sim.ha.leader])
            elif sim.ha is None:
                sim.restart_scheduler()
        elif roll < 0.7:
            sim.trace.append(f"as the job ends: partition {proc.node_id}")
            sim.note(f"as the job ends: partition {proc.node_id}")
            sim.net.partition(proc.node_id)
            self.cut_until[proc.node_id] = now + sim.node_timeout_s + 2.0
        else:
            sim.trace.append(f"as the job ends: kill {proc.node_id}")
            sim.note(f"as the job ends: kill {proc.node_id}")
            sim.kill(proc)

    # -- a simple process's Finish ---------------------------------------------------------

    def send(self, proc: Process) -> None:
        """`proc` (again) sends its Finish, while it is in and not heard: on its connection."""
        if proc.finishing and proc.member and self.sim.cores is None:
            self.sim.send_on_stream(proc, ("finish", proc.incarnation, 0))

    def on_simple_answer(self, proc: Process, code: str, details: str) -> None:
        if not proc.finishing:
            return
        if not code:
            self.done(proc)
        elif code in FINISH_RETRIED:  # cut off, or the node must register again first
            proc.member = False
        else:
            self.sim.note(f"{proc.node_id} exits, its finish unheard: {details}")
            self.sim.kill(proc)
            proc.ended = "unheard"

    def done(self, proc: Process) -> None:
        """`proc` was told its Finish was heard: finalize() returns, the process exits 0."""
        self.check_counted(proc)
        self.heard.add((proc.job, proc.node_id))
        self.sim.note(f"{proc.node_id} finished")
        self.sim.kill(proc)
        proc.ended = "finished"

    # -- the scheduler ---------------------------------------------------------------------

    def on_finish(self, node_id: str, incarnation: int, number: int) -> None:
        """As `SchedulerCore.finish`: admit, apply, answer once saved."""
        sim, st = self.sim, self.sim.state
        if number and self.calls.get(node_id) != number:
            return  # a core's call cancelled at its deadline before it arrived
        digest = auth.credential_digest(f"{node_id}:{incarnation}".encode())
        member = st.admission.admit_finish(node_id, incarnation, auth.Presented(digest=digest))
        if isinstance(member, Denied):
            self.refused[member.kind.value] += 1
            code = failures.status_of(member.error())[0].name
            refused = ("finish-answer", incarnation, number, code, member.message)
            if member.kind is Denial.JOB_OVER:  # it tells the job's failure: once saved
                self.answers.append((st.revision, node_id, refused))
                self.answer_saved()
            else:
                self.answer(node_id, refused)
            return
        decided: list[Any] = [*st.finish(node_id, incarnation)]
        if member.state is NodeState.FINISHED and st.phase is Phase.READY:
            reason = f"{member.describe()} has finished (called cluster.finalize())"
            decided.append(FailRounds(reason, CollectiveError, keep_answer=True))
        sim.step_machine(decided)
        answer = ("finish-answer", incarnation, number, "", "")
        if sim.plant == "early-finish-answer":
            self.answer(node_id, answer)
            return
        self.answers.append((st.revision, node_id, answer))
        self.answer_saved()

    def answer(self, node_id: str, answer: tuple[Any, ...]) -> None:
        self.sim.net.send(self.sim.clock.now, SCHED, node_id, answer, stream=True)

    def answer_saved(self) -> None:
        saved = int(self.sim.stored["revision"])
        for _, node_id, answer in [a for a in self.answers if a[0] <= saved]:
            self.answer(node_id, answer)
        self.answers = [a for a in self.answers if a[0] > saved]

    def restart(self) -> None:
        """The scheduler died: its answers not sent die with it, and every core's Finish call
        on its way fails UNAVAILABLE."""
        self.answers = []
        for node_id, number in sorted(self.calls.items()):
            failed = steps.FinishFailed("UNAVAILABLE", "the scheduler's connection broke")
            proc = self.sim.processes[node_id]
            self.sim.cores.after(proc, 0.0, failed, finish=number)  # type: ignore[union-attr]

    # -- a worker core's Finish ------------------------------------------------------------

    def send_core(self, proc: Process, timeout_s: float) -> None:
        number = self.calls[proc.node_id] = next(self.numbers)
        self.sim.send_on_stream(proc, ("finish", proc.incarnation, number))
        deadline = steps.FinishFailed("DEADLINE_EXCEEDED", "the Finish call timed out")
        self.sim.cores.after(proc, timeout_s, deadline, finish=number)  # type: ignore[union-attr]

    def hold(self, proc: Process, timeout_s: float) -> None:
        self.holds_made += 1
        number = self.holds[proc.node_id] = next(self.numbers)
        self.sim.cores.after(  # type: ignore[union-attr]
            proc, timeout_s, steps.FinishRetryDue(), finish=number
        )

    def back(self, proc: Process) -> None:
        """The node was accepted again, or is over: its held Finish goes on."""
        number = self.holds.get(proc.node_id)
        if number is not None:
            self.sim.cores.after(  # type: ignore[union-attr]
                proc, 0.0, steps.FinishRetryDue(), finish=number
            )

    def due(self, proc: Process, number: int) -> bool:
        """Whether the timer of Finish call or hold `number` still counts (and ends it)."""
        if self.calls.get(proc.node_id) == number:
            del self.calls[proc.node_id]
            return True
        if self.holds.get(proc.node_id) == number:
            del self.holds[proc.node_id]
            return True
        return False

    def on_core_answer(self, proc: Process, number: int, code: str, details: str) -> None:
        if self.calls.get(proc.node_id) != number:
            return  # a call given up on
        del self.calls[proc.node_id]
        if not code:
            self.step_core(proc, steps.FinishAnswered(heard=True))
            return
        cores = self.sim.cores
        assert cores is not None
        up = proc.member and cores.streams.get(proc.node_id) is not None
        self.step_core(proc, steps.FinishFailed(code, details, stream_up=up))

    def step_core(self, proc: Process, event: steps.Event) -> None:
        """Step `proc`'s core with a Finish event and carry out what it says; then, its
        Finish heard, the process exits 0 (`finish-counted`); ended unheard without a failure,
        it exits 0 too (`finish-held`: never after a cut-off)."""
        cores = self.sim.cores
        assert cores is not None
        core = cores.cores[proc.node_id]
        if isinstance(event, steps.FinishFailed):
            # A call that timed out while the node lost its stream too was cut off with it.
            cut = event.code == DEADLINE_EXCEEDED and core.lifecycle is Lifecycle.RECONNECTING
            self.failed_with[proc.node_id] = f"{event.code}{CUT_OFF}" if cut else event.code
        was_out = core.finish.out
        cores.carry(proc, core.step(event))
        if not proc.running:
            return  # it failed (reported), or ended with the job
        if core.finish.heard:
            self.done(proc)
        elif (was_out or isinstance(event, steps.FinishSent)) and not core.finish.out:
            self.check_held(proc)
            self.sim.note(f"{proc.node_id} exits, its finish unheard")
            self.sim.kill(proc)
            proc.ended = "unheard"

    def forget(self, proc: Process) -> None:
        """A process ended or a new one started: its calls died with the old one."""
        for table in (self.calls, self.holds, self.failed_with):
            table.pop(proc.node_id, None)
        self.ends.pop(proc.node_id, None)

    # -- invariants ------------------------------------------------------------------------

    def check_counted(self, proc: Process) -> None:
        """`finish-counted`: what the scheduler saved has `proc`'s node finished."""
        stored = self.sim.stored
        if stored["cluster_id"] != proc.job or stored["phase"] in ("finished", "failed"):
            return
        saved = {m["node_id"]: m for m in [*stored["members"], *stored["spares"]]}
        member = saved.get(proc.node_id)
        if member is None or member["rank"] is None or member["replaced_by"]:
            return
        if member["state"] != NodeState.FINISHED.value:
            raise self.sim.violation(
                "finish-counted",
                f"node {proc.node_id} was told its Finish was heard, but the scheduler saved it "
                f"{member['state']} with rank {member['rank']} (revision {stored['revision']})",
            )

    def check_restored(self) -> None:
        """`finish-counted`: a restarted scheduler knows every Finish heard in its job."""
        st = self.sim.state
        if st.phase is not Phase.READY:
            return
        for job, node_id in sorted(self.heard):
            member = st.find(node_id)
            if job != st.cluster_id or member is None or member.state is NodeState.FINISHED:
                continue
            if member.rank is not None and not member.replaced_by:
                raise self.sim.violation(
                    "finish-counted",
                    f"node {node_id}'s Finish was heard, but the scheduler restarted on "
                    f"revision {self.sim.stored['revision']} holds it {member.state.value}",
                )

    def all_heard(self, job: str) -> bool:
        """Whether every rank's node of the job's newest generation told had its Finish heard."""
        holders = self.sim.peers_told.get(job, {}).values()
        return bool(holders) and all((job, node) in self.heard for node in holders)

    def check_told(self, job: str, effect: Any) -> None:
        """`job-end` and `finished-quiet`, as the scheduler tells `effect`."""
        if isinstance(effect, TopologyReadyEvent):
            self.generations[(job, effect.generation)] = effect
        if isinstance(effect, ShutdownEvent) and not effect.ok and self.all_heard(job):
            raise self.sim.violation(
                "job-end",
                f"every rank of {job} had its Finish heard, but the job is told failed: "
                f"{effect.reason}",
            )
        if isinstance(effect, NodeFailedEvent) and (job, effect.node_id) in self.heard:
            raise self.sim.violation(
                "finished-quiet",
                f"node {effect.node_id} had its Finish heard, but its failure is told: "
                f"{effect.reason}",
            )

    def check_settled(self, waited_s: float) -> None:
        """`job-end` as the job settles: ended well once every rank finished."""
        st = self.sim.state
        if not self.all_heard(st.cluster_id):
            return
        if st.phase is Phase.FAILED:
            raise self.sim.violation("job-end", f"every rank finished; the job failed: {st.detail}")
        if st.phase is not Phase.FINISHED:
            raise self.sim.violation(
                "job-end",
                f"every rank of {st.cluster_id} had its Finish heard, but the job is still "
                f"{st.phase.value} {waited_s:g} s after the faults stopped",
            )

    def check_quiet(self, proc: Process) -> None:
        """`finished-quiet`: a core whose Finish was heard fails no more."""
        cores = self.sim.cores
        if cores is not None and cores.cores[proc.node_id].finish.heard:
            raise self.sim.violation(
                "finished-quiet", f"node {proc.node_id} had its Finish heard, then failed"
            )

    def check_held(self, proc: Process) -> None:
        """`finish-held`: a Finish cut off with its scheduler is not given up silently."""
        code = self.failed_with.get(proc.node_id, "")
        if code in FINISH_RETRIED or code.endswith(CUT_OFF):
            core = self.sim.cores.cores[proc.node_id]  # type: ignore[union-attr]
            raise self.sim.violation(
                "finish-held",
                f"node {proc.node_id} gave its Finish up unheard after it was cut off ({code}), "
                f"and exits as done ({core.lifecycle.value}, {Sending.NOT_SENT.value})",
            )


__all__ = ["FINISH_EVENTS", "NOT_STEPS", "Finishes"]
