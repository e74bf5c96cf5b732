"""What a worker has put back, as its checkpoint reports say: the generation whose rollback step
it had put back when it listed its steps.

A worker puts a generation's rollback step back once the steps past it are gone from its rank's
files (the abandoned run's: the new run writes steps of the same numbers), and its reports say so
from then on; before, the scheduler counts none of its steps past that step
(`RollbackPlanner.holdings`). Pure rules, with or without a `TrainingLoop`: where a process
starts (`put_back_at_start`), and what a discard puts back (`put_back_by_discarding`).
"""

from __future__ import annotations


def first_start(generation: int, rollback_step: int, rejoined: bool) -> bool:
    """Whether a worker whose process takes `generation` (rollback step `rollback_step`) as its
    first starts the job, from the state as made: generation 1 from step 0, the process not in
    a failed one's place (`rejoined`)."""
    return generation == 1 and rollback_step == 0 and not rejoined


def put_back_at_start(generation: int, rollback_step: int, rejoined: bool) -> int:
    """The generation whose rollback step a worker's process has put back when it takes
    `generation` as its first: that one on the job's first start (nothing to put back), else
    the one before, until it puts this one back (a restarted worker, a promoted spare: its
    rank's files may hold steps of a run the job abandoned)."""
    return generation if first_start(generation, rollback_step, rejoined) else generation - 1


def put_back_by_discarding(step: int, generation: int, rollback_step: int) -> int:
    """The generation a worker in `generation`, whose rollback step is `rollback_step`, puts
    back by discarding its checkpoints newer than `step`: that generation when `step` is at or
    before its rollback step (no step of a run the job abandoned is left), else none (0): a
    step past it may be one."""
    return generation if step <= rollback_step else 0


def saved_before_put_back(step: int, generation: int, rollback_step: int, reported: int) -> bool:
    """Whether a save of `step` in `generation` (rollback step `rollback_step`) comes before its
    worker put that generation back (its reports say `reported`): the scheduler counts none of
    its steps past the rollback step until it does (`put_back_by_discarding`)."""
    return reported < generation and step > rollback_step
