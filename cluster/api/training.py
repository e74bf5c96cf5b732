"""A training loop that survives worker failures: checkpoints, and a cluster-wide rollback.

A plain loop becomes recoverable with two lines:

    loop = cluster.TrainingLoop(steps, checkpoints, get_state, set_state)
    for step in loop:            # was: for step in range(steps):
        with loop.step():        # a peer's failure inside is handled, not raised
            train_one_step(step)

Every generation of the job names a rollback step (the newest checkpoint every worker holds).
The loop starts from it, saves checkpoints when they are due (a save costs the loop a copy of
the state into memory; the file is written in the background, and the loop waits for the last
one before it ends), and when a peer fails (a
`PeerFailedError` in a collective) or the job moves to a new generation between two steps, it
waits for the new generation, puts the state of its rollback step back with `set_state`, and
goes on from that step. Every worker does the same, the restarted one from its start, so a job
with faults ends with exactly the parameters of the same job without faults, provided a step
depends only on the state and the step number (derive the batch from the step; initialise every
rank the same way).

The loop also keeps a copy of the state of its last step boundary in memory (`StepMemory`,
bounded by `CheckpointConfig.memory_snapshot`). On taking a new generation, every worker tells
the others, in one allgather, which step it holds so; when every worker can get the state of
the same step that way (the survivors their own copy, a newcomer a peer's), the job resumes
from that step instead of the rollback step on disk (`cluster.protocol.resume`), so a failure
costs at most the step it interrupted. That allgather is the first collective of every
generation after the first. A restarted worker or a promoted spare runs the program from its
start, so whatever collectives the program makes before its loop come first there, and the
survivors, already in their loop, make none of them: a process group made before the loop with
`cluster.torch.init_process_group()` is made again by every loop at that point, before the
allgather (`remake_at_resume`), so the survivors' collectives there are the newcomer's. Any
other collective made before the loop meets the allgather of a survivor, which then raises a
ConfigError that says so: make such collectives in `set_state` or in a step.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from cluster.api import data_plane, runtime, worker_metrics
from cluster.api.collective import allgather_bytes, barrier
from cluster.protocol import resume
from cluster.protocol.errors import (
    CheckpointError,
    CollectiveError,
    CollectiveMismatchError,
    ConfigError,
    NoPeerStateError,
    PeerFailedError,
    PeerFinishedError,
)
from cluster.protocol.put_back import first_start

if TYPE_CHECKING:
    from cluster.api.checkpoint import CheckpointManager
    from cluster.api.memory import InitialState, StepMemory
    from cluster.protocol.topology import Topology


# True while a TrainingLoop's set_state puts back the state of its last step (`restoring_the_end`).
_restoring_the_end = False
# True once a TrainingLoop of this process has begun iterating (`before_any_loop`).
_loop_began = False
# Called by every TrainingLoop before its first collective of a new generation (`remake_at_resume`).
_remakes: list[Callable[[], None]] = []


def before_any_loop() -> bool:
    """Whether no TrainingLoop of this process has begun iterating yet."""
    return not _loop_began


def remake_at_resume(remake: Callable[[], None]) -> None:
    """Have `remake()` called by every TrainingLoop at the resume point of each generation after
    the first, before the loop's first collective of it, with the collectives pinned to that
    generation (a PeerFailedError from it is a peer's failure, as in a step). cluster.torch
    makes there again a group that the program made before its loop: a restarted worker or a
    spare made it at the start of the program, in the new generation, before its loop's first
    collective, and each survivor now makes it at the same point (see the module)."""
    if remake not in _remakes:
        _remakes.append(remake)


class TrainingLoop:
    """`for step in loop:` with `with loop.step():` around the step's work; see the module."""

    def __init__(
        self,
        steps: int,
        checkpoints: CheckpointManager,
        get_state: Callable[[], Mapping[str, Any]],
        set_state: Callable[[dict[str, Any]], None],
        *,
        say: Callable[[str], None] | None = None,
    ) -> None:
        """`get_state()`: what a checkpoint holds (parameters, optimizer state, ...);
        `set_state(state)`: put such a state back (the collectives it makes belong to the
        generation it restores; when it restores the last step, `restoring_the_end()`, it
        must make none). The state at construction is the state of step 0: a host copy of it
        is kept for a rollback to step 0 until every rank holds a checkpoint
        (`cluster.api.memory.InitialState`)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(
                f"TrainingLoop steps={steps!r} is invalid: it must be an integer >= 0, the number "
                "of training steps"
            )
        self.steps = steps
        self.checkpoints = checkpoints
        checkpoints.connect()  # one made before cluster.init(): the job's rank and recovery
        # Whether recovery is on: the job's, as the manager took it (`CheckpointManager`), and
        # the copies below are kept for it; `_start` checks it once in the job.
        self._recovery = checkpoints.recovery
        self._get_state = get_state
        self._set_state = set_state
        self._say = say or _say
        self._generation = 0
        self._interrupted: PeerFailedError | None = None
        self._furthest = 0
        # This generation resumed at the end (its rollback step is the last step): see
        # `_agree_on_the_end`.
        self._resumed_at_the_end = False
        self.rollbacks = 0
        # The state of the last step boundary, a copy (CheckpointConfig.memory_snapshot). Its
        # module imports numpy, as the manager's does: not at `import cluster`.
        from cluster.api.memory import InitialState, StepMemory  # noqa: PLC0415

        self.memory: StepMemory = StepMemory(checkpoints, self._say)
        # The state of step 0, for a rollback to it, until every rank holds a checkpoint.
        self._initial: InitialState = InitialState(checkpoints, get_state())
        # Steps this worker computed again after rollbacks (work lost to failures).
        self.steps_redone = 0
        worker_metrics.start()  # CLUSTER_WORKER_METRICS_PORT: off unless set

    @staticmethod
    def restoring_the_end() -> bool:
        """Whether a TrainingLoop's `set_state` is now putting back the state of the loop's
        last step (`step >= steps`). No step follows, and a peer may have finished already
        (called cluster.finalize()), so set_state must make no collective:
        cluster.torch.init_process_group() makes no group then (it returns False)."""
        return _restoring_the_end

    # -- the loop ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        step = self._start()
        while True:
            if runtime.topology().generation != self._generation:
                step = self._roll_back(waited=False)
            elif step < self.steps:
                self._interrupted = None
                started = time.perf_counter()
                yield step
                if self._interrupted is not None:
                    step = self._roll_back(waited=True)
                else:
                    step += 1
                    worker_metrics.step_done(started)
                    self._furthest = max(self._furthest, step)
                    self._boundary(step)
            elif self._agree_on_the_end():
                self.memory.close()
                self._initial.let_go()
                return
            else:
                step = self._roll_back(waited=True)

    def _boundary(self, step: int) -> None:
        """The state of `step` is complete: save it when due, and keep it in memory."""
        state = self._get_state()
        saved = self._saves(step)
        if saved:
            with worker_metrics.checkpoint(step):
                self.checkpoints.save(step, state)
        self.memory.keep(step, state, saved=saved)
        if self.checkpoints.held_by_all > 0:  # no rollback to step 0 from now on
            self._initial.let_go(self.checkpoints.held_by_all)

    def _saves(self, step: int) -> bool:
        """Whether every worker saves a checkpoint of `step`."""
        return self.checkpoints.should_save(step) or step == self.steps

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one step's work: a peer's failure in it ends the step early, for a rollback.

        That is a PeerFailedError from a cluster collective; an error of the data plane (gloo,
        NCCL) when the scheduler confirms, within MS_NODE_TIMEOUT + 2 s, that a peer of this
        generation failed (the wait is said in a line); any other error when the scheduler
        already knows that a peer failed. Other errors are raised at once
        (`cluster.api.data_plane`).
        """
        session = runtime.session()
        # The step's collectives belong to the generation it began in: if the job moves on
        # meanwhile, they fail (a PeerFailedError) instead of joining the new generation's.
        session.generation_pin = self._generation
        try:
            yield
        except PeerFailedError as exc:
            self._interrupted = exc
        except Exception as exc:
            if not data_plane.a_peer_failed(self._generation, exc, self._say):
                raise
            self._interrupted = PeerFailedError(f"a peer failed during the step: {exc}")
        finally:
            session.generation_pin = None

    def run(self, train_step: Callable[[int], None]) -> None:
        """The whole loop: `train_step(step)` for each step, rolled back as needed."""
        for step in self:
            with self.step():
                train_step(step)

    # -- rollback ----------------------------------------------------------------------------

    def _start(self) -> int:
        global _loop_began
        _loop_began = True
        self._check_recovery()
        topology = runtime.topology()
        self._generation = topology.generation
        if first_start(topology.generation, topology.rollback_step, runtime.is_rejoin()):
            self.memory.keep_initial(self._initial)
            runtime.resumed_in(topology.generation)
            return 0  # a first start: the state as constructed
        # The rank's files may hold steps of a run the job abandoned: until this process puts
        # back a rollback step (`_restore`), its reports say the generation before this one.
        runtime.resumed_in(topology.generation - 1)
        restored = self._take(topology, rolled_back=False)
        return self._roll_back(waited=True) if restored is None else restored

    def _check_recovery(self) -> None:
        """The manager connected to the job (a loop made before `cluster.init()`: ConfigError
        when the job's recovery is not the one the loop was made for, whose copies of the state
        of step 0 and of its steps are kept with recovery only)."""
        self.checkpoints.connect()
        if self.checkpoints.recovery != self._recovery:
            made, runs = ("with", "without") if self._recovery else ("without", "with")
            raise ConfigError(
                f"this TrainingLoop was made before cluster.init() for a job {made} recovery "
                f"(MS_ENABLE_RECOVERY as it was then), but the job that cluster.init() joined "
                f"runs {runs} it: make the TrainingLoop after cluster.init()"
            )

    def _roll_back(self, *, waited: bool) -> int:
        while True:
            runtime.generation_over()  # a process group's connections: peers blocked on them
            if waited:
                self._say(
                    "a peer failed; waiting for the job's next generation"
                    if self._interrupted is not None
                    else "waiting for the job's next generation"
                )
                runtime.wait_for_generation(self._generation)
            topology = runtime.topology()
            self._generation = topology.generation
            restored = self._take(topology, rolled_back=True)
            if restored is not None:
                return restored
            waited = True  # a peer failed while the state was put back: the next generation

    def _take(self, topology: Topology, *, rolled_back: bool) -> int | None:
        """Resume in `topology`'s generation; the step, or None when a peer failed meanwhile."""
        where = self._where(topology)
        if where is None:
            return None
        if rolled_back:
            self.rollbacks += 1
            lost = max(self._furthest - where.step, 0)
            self.steps_redone += lost
            worker_metrics.rolled_back(lost)
            self._say(
                f"rolled back from step {self._furthest} to step {where.step} "
                f"({lost} steps to compute again)"
            )
        return self._restore(where, topology)

    def _where(self, topology: Topology) -> resume.Resume | None:
        """Where the generation resumes: every worker contributes the step it holds in memory
        to one allgather and decides alike (`cluster.protocol.resume`); None when a peer failed
        meanwhile. The first generation, and one whose rollback step is the end, need none.
        Before the allgather, what was registered with `remake_at_resume` is made again."""
        disk = topology.rollback_step
        if topology.generation == 1 or disk >= self.steps:
            return resume.Resume(disk, False, (), "the rollback step")
        session = runtime.session()
        session.generation_pin = topology.generation
        try:
            for remake in list(_remakes):
                remake()
            gathered = allgather_bytes(resume.encode(self.memory.step))
        except PeerFailedError as exc:
            self._interrupted = exc
            return None
        except CollectiveMismatchError as exc:
            raise _met_another_collective(topology.generation, exc) from exc
        finally:
            session.generation_pin = None
        held = [resume.decode(value) for value in gathered]
        replicated = self.checkpoints.config.replicated
        return resume.decide(held, disk, replicated=replicated)

    def _restore(self, where: resume.Resume, topology: Topology) -> int | None:
        """Put the state of `where.step` back; None when a peer failed meanwhile (set_state may
        make a process group, which needs every peer; a peer may die while it serves).

        set_state belongs to the generation it restores, as a step does: its collectives (the
        store port's broadcast of cluster.torch.init_process_group) fail with PeerFailedError
        once the job has moved past it, instead of meeting the next generation's first one."""
        global _restoring_the_end
        step, generation = where.step, topology.generation
        source = where.source(topology.rank, self.memory.step)
        state = None if source == "peer" and step > 0 else self._state_of(step, source, topology)
        session = runtime.session()
        session.generation_pin = generation
        _restoring_the_end = step >= self.steps
        try:
            if state is None:  # from a server's memory, which may fail meanwhile
                state = self._peer_copy(step, topology.rollback_step)
            self._set_state(state)
        except PeerFailedError as exc:
            self._interrupted = exc
            return None
        except Exception as exc:
            if not data_plane.a_peer_failed(generation, exc, self._say):
                raise
            self._interrupted = PeerFailedError(f"a peer failed while restoring: {exc}")
            return None
        finally:
            session.generation_pin = None
            _restoring_the_end = False
        self._resumed_at_the_end = step >= self.steps
        # Put back once the steps past it are gone: only the report made then says so.
        self.checkpoints.discard_newer(step, put_back=generation)
        self._furthest = max(self._furthest, step)
        if self.memory.step != step:
            self.memory.keep(step, self._get_state(), saved=False)
        self._say(f"generation {generation} ({topology.reason}): {_resuming(where, source)}")
        if where.in_memory and topology.rank == 0 and runtime.is_initialized():
            runtime.report_memory_resume(generation, step, where.why, self.checkpoints.steps())
        return step

    def _peer_copy(self, step: int, disk: int) -> dict[str, Any]:
        """The state of `step`, which the servers hold in memory. A rank's checkpoints are the
        steps every worker saves, so that the rollback step (the newest step every rank holds)
        is one they all hold: at such a step, this rank's own file, or a server's copy stored
        as this rank's checkpoint (`load`); at any other, a server's copy that is not stored or
        reported (`fetch_state`), which would be a step that this rank alone holds.

        The scheduler counts this rank as holding the generation's rollback step on disk,
        `disk` (a newcomer takes the rank with the steps reported for it), and the next
        generation rolls back to it when nobody holds a step in memory then (every worker
        failed at once). So a newcomer whose files lack it gets it too, from a peer, as this
        rank's file (`fetch`), before its report says what it holds: a report without it
        would make the rollback step 0, with every step lost."""
        if self._saves(step) or step in self.checkpoints.steps():
            state = self.checkpoints.load(step)
        else:
            state = self.checkpoints.fetch_state(step)
        if 0 < disk < step and disk not in self.checkpoints.steps():
            self._hold_rollback_step(disk)
        return state

    def _hold_rollback_step(self, disk: int) -> None:
        """Fetch the generation's rollback step `disk` as this rank's file (see `_peer_copy`).
        When no live peer gives it, this worker goes on from the state it has, and says what
        that costs: it reports no such step, so the rollback step becomes 0."""
        try:
            self.checkpoints.fetch(disk)
        except NoPeerStateError as exc:
            asked = "; ".join(exc.failures) or "no live peer serves checkpoints"
            self._say(
                f"this rank does not hold the rollback step {disk} on disk, and no live peer gave "
                f"it ({asked}): until its next checkpoint, a failure that no worker can resume "
                "from memory rolls the job back to step 0 (a worker that no longer holds the "
                "state of step 0 stops then, to be restarted)"
            )

    def _state_of(self, step: int, source: str, topology: Topology) -> dict[str, Any]:
        if source == "own":
            return self.memory.state()
        if step > 0:
            return self.checkpoints.load(step)
        initial = self._initial.state()
        if initial is None:
            raise _initial_gone(topology, self._initial.let_go_at)
        return initial

    def _agree_on_the_end(self) -> bool:
        """True once every worker holds the final state; False after a peer failed first.

        Every worker of the generation passes a barrier before it finishes, also in a
        generation that resumed at the end (every rank had saved the final state): a newcomer
        may be fetching that state from the others, whose state servers stop when they
        finalize. There, a barrier that cannot complete because a peer has finished already
        means that every worker passed the end before (this one was killed after it): this one
        is done too (`_finished_before`)."""
        self.checkpoints.flush()  # the final state on disk and reported, before the barrier
        session = runtime.session()
        session.generation_pin = self._generation
        try:
            barrier()
        except PeerFailedError as exc:
            self._interrupted = exc
            return False
        except CollectiveError as exc:
            if not self._finished_before(exc):
                raise
        finally:
            session.generation_pin = None
        return True

    def _finished_before(self, exc: CollectiveError) -> bool:
        """Whether the end barrier's `exc` says that the others finished the job already: a
        PeerFinishedError (a rank of the generation has finished), in any generation (the
        barrier's answer may have been lost with a scheduler that restarted as it was told),
        or a plain CollectiveError (a scheduler that gives no reason) in a generation that
        resumed at the end. Peers finish only past an end barrier that every rank reached, so
        none of them waits for this worker (said in a line)."""
        plain = self._resumed_at_the_end and type(exc) is CollectiveError
        if not (plain or isinstance(exc, PeerFinishedError)):
            return False
        self._say(f"the other workers finished the job before this one came back ({exc})")
        return True


def _met_another_collective(generation: int, exc: CollectiveMismatchError) -> ConfigError:
    """The resume agreement of `generation` met another collective of a peer (`exc`)."""
    return ConfigError(
        f"the TrainingLoop's first collective of generation {generation} (where to resume, an "
        f"allgather) met another one: {exc}. A restarted worker or a spare runs the program "
        "from its start, so a collective made before the loop (cluster.barrier(), a "
        "broadcast, a process group made other than with cluster.torch.init_process_group()) "
        "comes first there, and not in the survivors: make it in set_state or in a step"
    )


def _initial_gone(topology: Topology, held: int) -> CheckpointError:
    """A rollback to step 0 in `topology`'s generation, after this worker let the state of step
    0 go once every rank held a checkpoint of `held`."""
    return CheckpointError(
        f"generation {topology.generation} rolls back to step 0 ({topology.reason}), but this "
        "worker no longer holds the state of step 0: it let it go once the scheduler said every "
        f"rank held a checkpoint (of step {held}), so a rank's checkpoints were lost since "
        "(removed by hand, or a disk lost). Restart this worker (a new process makes the "
        "state of step 0 again; mscluster run --max-restarts does), or put the lost checkpoint "
        "files back and restart the job"
    )


def _resuming(where: resume.Resume, source: str) -> str:
    if not where.in_memory:
        return f"resuming from step {where.step}"
    mine = {"own": "this worker's copy", "peer": "a peer's copy"}[source]
    return f"resuming from step {where.step} in memory ({mine}; {where.why})"


def _say(message: str) -> None:
    sys.stderr.write(f"cluster[rank {runtime.get_rank()}]: {message}\n")  # one write: see
    sys.stderr.flush()  # cluster.worker.session._say
