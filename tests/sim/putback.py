"""The workers' put-back of a generation's rollback step, as a `TrainingLoop` makes it
(`cluster/api/training.py`), and the run each checkpoint file's state comes from.

A worker that hears a generation G, with rollback step R and a rank, takes R on once every rank
of G has heard G (the loop's first collective of a generation: an allgather of every rank), and
puts it back a second later (`set_state` takes its time), whatever it hears meanwhile. Its
checkpoint writer first ends the write it had under way, a step of the run before G, whose
steps are listed and reported then (the writer may be a save behind the loop, `LATE_WRITE`,
and ends that write on its own time too, `LAND_EACH_S`); then the worker discards its rank's
steps newer than R and reports what is left. That report says it put back G; every list taken
before says the generation it had put back before (a fresh process, a restarted worker or a
promoted spare: the one before G; the first start of a job, generation 1 from step 0, has
nothing to put back). The worker waits for the answer to it (sent again each second, as a
retried call), and a rank trains on only once every rank of G has had it (each step ends in a
collective of every rank: no rank saves a step of G before every rank's put-back is taken).

Every file holds a state, labelled by the generation whose run computed it; the group's run
keeps the label of each step up to a generation's rollback step and gives the steps it computes
past it the generation's. Invariant `lineage`: the rollback step a generation names is one state
on every rank that holds it, a step of one run, never one rank's step of a run the others
abandoned. Plant `keep-abandoned`: a worker puts R back but keeps the steps past it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cluster.protocol.records import TopologyReadyEvent

if TYPE_CHECKING:
    from tests.sim.control_plane import Process, Sim

# The chance, each second, that a rank's writer ends the write it has under way (its loop may
# be a save ahead), and that a second of a rank's loop ends in a save; and that a save's file
# is still being written when the loop goes on. From the simulation's own stream for them.
LAND_EACH_S = 0.5
SAVE_EACH_S = 0.3
LATE_WRITE = 0.3


def heard(sim: Sim, proc: Process, event: TopologyReadyEvent) -> None:
    """`proc` took generation `event` (with its rank, or none: a spare, which puts nothing
    back until it holds a rank). A put-back under way (`committed`) is made first."""
    proc.restoring = None
    if proc.rank is None:
        return
    done = proc.put_back.get(proc.job, 0)
    if event.generation == 1 and not done:  # the job's first start: from step 0, as made
        proc.put_back[proc.job] = 1
        return
    if not done:  # a fresh process: until it puts back its first step, the one before
        proc.put_back[proc.job] = event.generation - 1
    proc.restoring = (event.generation, event.rollback_step)


def report(sim: Sim, proc: Process) -> tuple[Any, ...]:
    """Report the steps `proc`'s rank holds now; the report sent."""
    assert proc.rank is not None
    proc.reports += 1
    files = sorted(sim.files.get(proc.rank, set()))
    body = ("report", proc.incarnation, files, proc.put_back.get(proc.job, 0), proc.reports)
    sim.send(proc, body)
    proc.last_report = body
    return body


def write(sim: Sim, rank: int, step: int, label: int) -> None:
    """A file of `step` (of the run `label`) is whole on `rank`'s disk: it replaces one of the
    same step and, as a writer prunes, the steps past it (`WriteBehind._prune`)."""
    files = sim.files.setdefault(rank, set())
    files.difference_update({s for s in files if s > step})
    files.add(step)
    sim.labels.setdefault(rank, {})[step] = label


def land(sim: Sim, proc: Process) -> None:
    """The write `proc`'s writer had under way ends: the file, pruning, the report."""
    if proc.writing is None or proc.rank is None:
        return
    step, label = proc.writing
    proc.writing = None
    write(sim, proc.rank, step, label)
    prune(sim, proc.rank)
    report(sim, proc)


def prune(sim: Sim, rank: int) -> None:
    """Keep the newest three and every step from the one all workers hold (as last heard)."""
    files = sim.files.setdefault(rank, set())
    keep = sim.keep_from.get(rank, 0)
    files &= {s for s in files if s >= keep} | set(sorted(files)[-3:])


def beat(sim: Sim, proc: Process) -> None:
    """A second of `proc` (a running member): its writer may end its write, its put-back under
    way is made, and its loop goes on (`train`), ending a step that is saved at times."""
    if proc.writing is not None and sim.late_rng.random() < LAND_EACH_S:
        land(sim, proc)
    if proc.committed is not None:
        put_back(sim, proc)
    elif sim.in_newest(proc) and not proc.paused and proc.rank is not None:
        train(sim, proc, saves=sim.late_rng.random() < SAVE_EACH_S)


def train(sim: Sim, proc: Process, *, saves: bool = True) -> None:
    """A step of `proc`'s loop, in its job's newest generation: a put-back under way is made;
    a rollback step to put back is taken on once every rank has heard its generation (the
    allgather that opens it), and put back at the next (`put_back`: `set_state` takes its
    time); else, once every rank has put its step back, a step ends (saved: `step`)."""
    if proc.committed is not None:
        put_back(sim, proc)
    elif proc.restoring is not None:
        generation, rollback_step = proc.restoring
        # A generation resumed at the end is opened by no allgather (a peer may have finished).
        at_end = rollback_step >= sim.finishes.end_step
        if at_end or every_rank(
            sim, proc, lambda p: p.generations.get(proc.job, [0])[-1] >= generation
        ):
            proc.committed, proc.restoring = proc.restoring, None
    elif saves and may_train(sim, proc):
        step(sim, proc)


def step(sim: Sim, proc: Process) -> None:
    """`proc`'s loop ends a step and saves it. The ranks train in step (data parallel): the
    group's steps go by ten, each rank saves each, and each step ends in a collective of every
    rank, so a rank that has saved the next one waits for the others."""
    upto = sim.progress + 10
    if proc.step >= upto or upto > sim.finishes.end_step:
        return  # in the collective of its next step, which waits for the others; or the end
    proc.step = upto
    generation = proc.generations.get(proc.job, [0])[-1]
    save(sim, proc, upto, sim.lineage.setdefault(upto, generation))
    if every_rank(sim, proc, lambda p: p.step >= upto):
        sim.progress = upto


def save(sim: Sim, proc: Process, step: int, label: int) -> None:
    """`proc` saves `step`: its writer writes it now, or it is still at it when the loop goes
    on (`LATE_WRITE`); the write before ends first."""
    assert proc.rank is not None
    land(sim, proc)
    if sim.late_rng.random() < LATE_WRITE:
        proc.writing = (step, label)
        return
    write(sim, proc.rank, step, label)
    prune(sim, proc.rank)
    report(sim, proc)


def put_back(sim: Sim, proc: Process) -> None:
    """`proc` puts back the rollback step it took on (`committed`), whatever it heard since:
    its writer's job under way ends first (listed and reported), then the steps newer than
    the rollback step go, and it reports what is left, saying it put that generation back."""
    assert proc.committed is not None
    generation, step = proc.committed
    if proc.rank is None:  # it joined another job since
        proc.committed = None
        return
    land(sim, proc)
    files = sim.files.setdefault(proc.rank, set())
    if step and step not in files:  # its disk was lost: fetched from a peer, kept as its own
        fetch(sim, proc.rank, step)
    if sim.plant != "keep-abandoned":
        files.difference_update({s for s in files if s > step})
    proc.committed, proc.step = None, step
    proc.put_back[proc.job] = max(proc.put_back.get(proc.job, 0), generation)
    proc.awaiting = report(sim, proc)


def fetch(sim: Sim, rank: int, step: int) -> None:
    """`rank` gets `step` from a peer that holds it and writes it as its own checkpoint
    (`CheckpointManager.load`), of the run the peer's is."""
    for peer, held in sorted(sim.files.items()):
        if peer != rank and step in held:
            write(sim, rank, step, sim.labels[peer][step])
            return


def every_rank(sim: Sim, proc: Process, test: Callable[[Process], bool]) -> bool:
    """Whether `test` holds for the running process of every rank of `proc`'s generation."""
    for node_id in sim.peers_told.get(proc.job, {}).values():
        peer = sim.processes[node_id]
        if not peer.running or peer.job != proc.job or not test(peer):
            return False
    return True


def may_train(sim: Sim, proc: Process) -> bool:
    """Whether `proc`'s step can end: every rank of its generation has put its rollback step
    back and had that report taken (a step's collective needs every rank in the step)."""
    generation = proc.generations.get(proc.job, [0])[-1]
    return every_rank(
        sim,
        proc,
        lambda p: (
            p.restoring is None
            and p.committed is None
            and p.awaiting is None
            and p.put_back.get(proc.job, 0) >= generation
        ),
    )


def answered(proc: Process, seq: int) -> None:
    """The answer to `proc`'s report `seq` came."""
    proc.answered_report = max(proc.answered_report, seq)
    if proc.awaiting is not None and proc.awaiting[4] == seq:
        proc.awaiting = None


def again(sim: Sim, proc: Process) -> None:
    """`proc` sends its unanswered put-back report again (a retried call); at the end of its
    training, its last report, until answered (its checkpoints' flush before the end
    barrier)."""
    if not proc.member:
        return
    if proc.awaiting is not None:
        sim.send(proc, proc.awaiting)
    elif (
        proc.last_report is not None
        and proc.answered_report < proc.reports
        and sim.progress >= sim.finishes.end_step
    ):
        sim.send(proc, proc.last_report)


def told(sim: Sim, ready: TopologyReadyEvent) -> None:
    """A generation is told: the group's run goes on from its rollback step."""
    sim.lineage = {s: label for s, label in sim.lineage.items() if s <= ready.rollback_step}


def check_lineage(sim: Sim, ready: TopologyReadyEvent) -> None:
    """The rollback step `ready` names is one state on every rank that holds it."""
    step = ready.rollback_step
    runs = {
        peer.rank: sim.labels.get(peer.rank, {}).get(step)
        for peer in ready.peers
        if step in sim.files.get(peer.rank, set())
    }
    if len(set(runs.values())) > 1:
        held = ", ".join(f"rank {rank}: of generation {run}" for rank, run in sorted(runs.items()))
        raise sim.violation(
            "lineage",
            f"generation {ready.generation} rolls back to step {step}, which the ranks hold "
            f"from different runs ({held})",
        )
