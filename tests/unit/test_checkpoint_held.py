"""What a rank keeps before it has heard a step every rank holds: two managers report to a
real scheduler state machine (`SchedulerState`, its clock moved by the test), one rank's writer
lagging the other's, and the job can roll back whenever a rank dies."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.scheduler.machine.rollback import HELD_BY_ALL_EVERY_S, NoCommonStep
from cluster.scheduler.machine.state import SchedulerState
from tests.conftest import FakeClock
from tests.unit.test_state import recovering


class Job:
    """Ranks 0 and 1 (nodes '0' and '1') of a job with recovery on; each rank's manager tells
    the scheduler's state machine what it holds, as `runtime.report_checkpoints` does."""

    def __init__(self, tmp_path: Path, keep: int) -> None:
        self.clock = FakeClock()
        self.state: SchedulerState = recovering(self.clock, n=2)
        self.answers: dict[int, list[int]] = {0: [], 1: []}
        self._seq = itertools.count(1)
        config = CheckpointConfig(keep_checkpoint_max=keep)
        self.ranks = [
            CheckpointManager(
                tmp_path, "net", config, rank=r, recovery=True, report=self._report_of(r)
            )
            for r in (0, 1)
        ]

    def _report_of(self, rank: int) -> Callable[[list[int]], int]:
        def report(steps: list[int]) -> int:
            self.state.report_checkpoints(str(rank), 1, steps, 1, next(self._seq))
            held = self.state.held_by_all()
            self.answers[rank].append(held)
            return held

        return report

    def write(self, rank: int, step: int) -> None:
        """`rank`'s writer puts `step` on disk and reports it."""
        self.ranks[rank].save(step, {"step": step})
        self.ranks[rank].flush()
        self.check()

    def check(self) -> None:
        """Were a rank to die now, the job rolls back to a step every rank has on disk; the
        newest step an answer named is on every rank's disk (another rank may be told it)."""
        step = self.state.rollback_step()
        assert not isinstance(step, NoCommonStep), step.message
        told = max(itertools.chain(*self.answers.values()), default=0)
        for manager in self.ranks:
            held = manager.steps()
            assert step == 0 or step in held, (step, manager.rank, held)
            assert told == 0 or told in held, (told, manager.rank, held, self.answers)


@pytest.mark.parametrize("keep", [2, 3])
def test_a_step_told_to_one_rank_is_kept_by_a_rank_that_heard_nothing_yet(
    tmp_path: Path, keep: int
) -> None:
    """Rank 0 writes steps 1 and 2, answered 0 (rank 1 holds none); a second later rank 1,
    whose writer lags two saves, reports step 1 and is told to keep it; rank 0, told nothing
    yet, writes step 3 and must keep step 1 too."""
    job = Job(tmp_path, keep)
    job.write(0, 1)
    job.write(0, 2)
    job.clock.advance(HELD_BY_ALL_EVERY_S)
    job.write(1, 1)
    assert job.answers == {0: [0, 0], 1: [1]}
    job.write(0, 3)
    assert 1 in job.ranks[0].steps()
    assert job.state.rollback_step() == 1
    for manager in job.ranks:
        manager.close()


@pytest.mark.parametrize("tick", [0.0, 0.3, HELD_BY_ALL_EVERY_S])
def test_a_writer_lagging_the_most_a_loop_allows_always_leaves_a_common_step(
    tmp_path: Path, tick: float
) -> None:
    """Rank 1's newest step reported is at most three saves behind the step rank 0 writes
    (two saves in its writer, one step of its loop); the scheduler's answers come as often as
    `tick` allows. Whenever a rank dies the job has a step to roll back to."""
    job = Job(tmp_path, keep=2)
    for step in range(1, 13):
        if step > 3:
            job.write(1, step - 3)
            job.clock.advance(tick)
        job.write(0, step)
        job.clock.advance(tick)
    job.write(1, 10)
    assert job.state.rollback_step() == 10
    for manager in job.ranks:
        manager.close()
