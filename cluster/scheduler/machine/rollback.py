"""The rollback planner, a part of the scheduler's state machine: the checkpoint step every
worker can roll back to in a new generation, and the step every worker must keep.

Workers report the checkpoint steps they hold; every generation names the newest step that
every worker holds. A worker that holds none can only start from the beginning as far as the
disk goes, so the step is 0 while any worker holds none (a worker that failed before its first
checkpoint). The workers may still resume from a newer step the survivors hold in memory: they
decide that among themselves once the generation is out (`cluster.protocol.resume`), so the
generation's reason says what they do either way (`from_the_beginning`). Taking "the
minimum of each rank's newest", as MindSpore does, can name a step that some rank has already
pruned; the newest common step cannot. When every worker holds checkpoints but none in common
(files lost or pruned), the job cannot roll back (`NoCommonStep`, with what each holds): going
back to the beginning would silently discard what every worker saved.

A worker's report counts for a generation only once the worker says it has put back that
generation's rollback step: it discards its steps newer than that step first (they belong to
the run the job abandoned, and the new run writes steps of the same numbers), and only the
steps it lists after say so (`RollbackPlanner.report`). Until then the planner takes the
worker as holding nothing newer than the generation's rollback step, which it holds
(`RollbackPlanner.holdings`), for the next generation's rollback step as for the step every
worker keeps: a step of the abandoned run, newer, may be on its way out of its disk, and
another rank's step of that number may already be the new run's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import field, replace

from cluster.protocol.display import listed
from cluster.protocol.records import Member
from cluster.protocol.value import frozen, mutable

# How stale the step every worker holds may be when a checkpoint report asks for it: at most one
# computation a second however many workers report (at 8,192 workers one takes about a ms).
HELD_BY_ALL_EVERY_S = 1.0


@frozen
class NoCommonStep:
    """The workers hold checkpoints, but no step is held by all: the job cannot roll back."""

    message: str


def held_steps(steps: Iterable[int]) -> tuple[int, ...]:
    """The checkpoint steps a report names, as a member holds them: sorted, once, none < 0."""
    return tuple(sorted({int(s) for s in steps if int(s) >= 0}))


def rollback_step(workers: Sequence[Member]) -> int | NoCommonStep:
    """The newest step every worker holds; 0 while any worker holds none; NoCommonStep when
    every worker holds checkpoints but none in common."""
    if not all(m.checkpoints for m in workers):
        return 0
    common = set(workers[0].checkpoints).intersection(*(m.checkpoints for m in workers[1:]))
    if common:
        return max(common)
    held = "; ".join(
        f"{m.describe()}: {', '.join(map(str, m.checkpoints)) or 'none'}"
        for m in sorted(workers, key=_by_rank)
    )
    return NoCommonStep(
        "no checkpoint step is held by every worker, so the job cannot roll back to a "
        f"consistent state ({held}); keep more checkpoints (keep_checkpoint_max) or restore "
        "the missing files"
    )


def from_the_beginning(workers: Sequence[Member]) -> str:
    """Why a generation's rollback step is 0 though some workers hold checkpoints (the workers
    that hold none), or "" when it is not. It says what the workers will do whichever way they
    decide: the scheduler does not know the steps they hold in memory."""
    empty = [m for m in workers if not m.checkpoints]
    if not empty or len(empty) == len(workers):
        return ""
    who = listed((m.describe() for m in sorted(empty, key=_by_rank)), 4)
    return (
        f"no checkpoint on disk yet at {who}, so the rollback step is 0: the workers "
        "resume from the step the survivors hold in memory if they can, else from the beginning"
    )


def _by_rank(m: Member) -> int:
    return m.rank if m.rank is not None else -1


@mutable
class RollbackPlanner:
    # `held_by_all` as last computed: (generation, when, step).
    _last: tuple[int, float, int] = (-1, 0.0, 0)
    # By node id, the generation whose rollback step the worker had put back when it listed
    # the steps the scheduler holds for it (`report`); none: it never reported. Saved with the
    # job (`saved`, `restored`): what a worker was told to keep depends on it.
    _put_back: dict[str, int] = field(default_factory=dict)
    # Each node's newest report: (its process's incarnation, the report's number); not saved.
    _report_seq: dict[str, tuple[int, int]] = field(default_factory=dict)

    def report(self, node_id: str, incarnation: int, numbered: tuple[int, int], now: int) -> bool:
        """Whether to take a report of `node_id`'s process `incarnation` (its current one: the
        caller refuses any other): `numbered` is the generation whose rollback step the worker
        had put back when it listed the steps (0: it did not say, an older worker: taken as
        `now`, the current generation) and the report's number in its process (0: none); one
        older than a report of the same process already heard is not taken. Numbers are
        compared within a process only: each process numbers its reports from 1, and
        incarnations are random, not ordered."""
        generation, seq = numbered
        if seq:
            last_incarnation, last_seq = self._report_seq.get(node_id, (incarnation, 0))
            if last_incarnation == incarnation and seq <= last_seq:
                return False  # overtaken by a newer report of the same process
            self._report_seq[node_id] = (incarnation, seq)
        put_back = generation or now
        if self._put_back.get(node_id) != put_back:
            self._put_back[node_id] = put_back
            self._last = (-1, 0.0, 0)  # what every worker holds is planned afresh
        return True

    def put_back(self, node_id: str) -> int:
        """The generation whose rollback step `node_id` had put back when it listed the steps
        the scheduler holds for it (0: it never reported)."""
        return self._put_back.get(node_id, 0)

    def forget(self, node_id: str) -> None:
        """`node_id` left the job for good: nothing of its reports is kept."""
        self._put_back.pop(node_id, None)
        self._report_seq.pop(node_id, None)

    def handed_over(self, failed: str, spare: str) -> None:
        """`spare` took `failed`'s rank and the steps reported for it (`spares.hand_over`): what
        those steps say they were listed after goes with them."""
        generation = self._put_back.pop(failed, None)
        if generation is not None:
            self._put_back[spare] = generation

    def saved(self) -> dict[str, int]:
        """What a restarted scheduler needs of the planner (the job's snapshot holds it): a
        put-back of generation 0 (a report before any generation) is as none, and not saved."""
        return {node_id: g for node_id, g in self._put_back.items() if g}

    def restored(self, saved: Mapping[str, int]) -> None:
        """The planner of a restarted scheduler, from `saved` (empty from a scheduler that did
        not save it: every worker is taken as not yet past the rollback step it was told).
        TypeError (or ValueError) when `saved` is not node ids to generations."""
        if not isinstance(saved, Mapping):
            raise TypeError(f"put_back is a {type(saved).__name__}, not a mapping")
        self._put_back = {str(node_id): int(g) for node_id, g in saved.items()}

    def holdings(
        self, generation: int, workers: Sequence[Member], published_step: int
    ) -> list[Member]:
        """The workers as the rollback step is planned from them in `generation`, whose
        rollback step is `published_step`: each with the steps it reported, except one whose
        steps were not listed after it put that step back, taken as holding those up to it.

        Such a worker holds the generation's rollback step (no worker prunes the step every
        worker keeps, and that is never past it while one has not put it back:
        `held_by_all`), and may hold the abandoned run's newer steps until it discards them:
        one of those, held by every rank, is not a state to roll back to. The workers may be
        discarding it right now, their reports of what is left on their way (found by the
        simulation, `tests/sim`, seed 93 with two spares), or another rank may hold the new
        run's step of that number."""
        return [
            m
            if not m.checkpoints
            or max(m.checkpoints) <= published_step
            or self._put_back.get(m.node_id, 0) >= generation
            else replace(m, checkpoints=tuple(s for s in m.checkpoints if s <= published_step))
            for m in workers
        ]

    def held_by_all(
        self, generation: int, workers: Sequence[Member], now: float, published_step: int
    ) -> int:
        """A step every worker holds, for them to keep (0: none): `rollback_step` of the
        `holdings`, computed at most every HELD_BY_ALL_EVERY_S. The newest step every worker
        holds only grows within a generation (a worker prunes no step at or past this one, and
        one that puts back the generation's rollback step keeps it), so a value from a moment
        ago is still held by every worker; a new generation computes it afresh.

        Never past the generation's rollback step (`published_step`) while a worker has not
        put it back: that worker may not have heard of the generation yet, and must still find
        its step (found by the simulation, `tests/sim`, seed 2375)."""
        last_generation, when, step = self._last
        if last_generation != generation or now - when >= HELD_BY_ALL_EVERY_S:
            newest = rollback_step(self.holdings(generation, workers, published_step))
            step = newest if isinstance(newest, int) else 0
            self._last = (generation, now, step)
        if any(self._put_back.get(m.node_id, 0) < generation for m in workers):
            step = min(step, published_step)
        return step
