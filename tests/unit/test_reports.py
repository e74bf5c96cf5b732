"""Checkpoint reports and what a node hears first, where a generation is decided but not yet
told (its save pending): rules the simulation (`tests/sim`) found wanting."""

from __future__ import annotations

import pytest

from cluster.protocol.errors import SnapshotError
from cluster.scheduler.machine.state import (
    Accepted,
    Phase,
    SchedulerState,
    TopologyReadyEvent,
)
from tests.unit.test_spares import GUARD, job, ready_events, spare_reg
from tests.unit.test_state import JOB, FakeClock, make_state, recovering, reg


def all_report(state: SchedulerState, steps: list[int], generation: int) -> int:
    for node_id in ("0", "1", "2"):
        state.report_checkpoints(node_id, 1, steps, generation)
    return state.held_by_all()


def test_a_report_overtaken_by_a_newer_one_is_ignored() -> None:
    state = recovering(FakeClock())
    state.report_checkpoints("1", 1, [10, 20, 30], 1, seq=5)
    revision = state.revision
    state.report_checkpoints("1", 1, [10, 20], 1, seq=4)  # sent before, arrived after
    assert state.members["1"].checkpoints == (10, 20, 30)
    assert state.revision == revision
    state.report_checkpoints("1", 1, [20, 30], 1, seq=5)  # a retry of the same report: once
    assert state.members["1"].checkpoints == (10, 20, 30)
    state.report_checkpoints("1", 1, [20, 30], 1, seq=6)
    assert state.members["1"].checkpoints == (20, 30)


def test_what_all_hold_stays_at_the_new_generations_step_until_all_resumed_in_it() -> None:
    """Generation 2 rolls back to step 10. Before every worker has put it back (and says so),
    none may be told to keep only newer steps: one that has not heard of generation 2 yet
    would prune step 10 and find nothing to roll back to."""
    clock = FakeClock()
    state = recovering(clock)
    assert all_report(state, [10], 1) == 10
    (ready,) = state.reform("a collective was cut off")
    assert isinstance(ready, TopologyReadyEvent)
    assert ready.rollback_step == 10
    clock.advance(5)  # past the planner's reuse of its last answer
    state.report_checkpoints("0", 1, [10, 20], 1)
    state.report_checkpoints("1", 1, [10, 20], 2)
    state.report_checkpoints("2", 1, [10, 20], 2)
    assert state.held_by_all() == 10  # rank 0 still reports from generation 1
    state.report_checkpoints("0", 1, [10, 20], 2)
    clock.advance(5)
    assert state.held_by_all() == 20


def test_a_worker_that_does_not_say_its_generation_is_not_waited_for() -> None:
    clock = FakeClock()
    state = recovering(clock)
    all_report(state, [10], 1)
    state.reform("a collective was cut off")
    clock.advance(5)
    assert all_report(state, [10, 20], 0) == 20  # an older worker: as before


def test_a_new_process_does_not_take_its_old_rank_from_a_generation_told_before() -> None:
    """Node 1's rank went to spare s0 in generation 2; its new process, back after the guard
    as a spare, takes rank 0 at once (node 0 failed meanwhile) in generation 3. Until those
    are saved, the generation told last is 1, whose row gives node 1 rank 1: its stream must
    not start with that."""
    clock = FakeClock()
    state = job(clock)
    told = state.catch_up()  # generation 1, as told
    state.disconnect("1", 1)
    clock.advance(GUARD + 1)
    state.disconnect("0", 1)
    outcome, effects = state.register(reg(state, "1", incarnation=2, cluster_id=JOB))
    assert isinstance(outcome, Accepted)
    assert [e.generation for e in ready_events(effects)] == [3]
    assert state.members["1"].rank == 0
    assert state.catch_up_for("1", told) == []
    assert state.catch_up_for("2", told) == told  # its rank is the same: it hears it


def reform(state: SchedulerState) -> TopologyReadyEvent:
    (ready,) = state.reform("a collective was cut off")
    assert isinstance(ready, TopologyReadyEvent)
    return ready


def test_steps_listed_before_a_worker_put_back_the_rollback_step_are_not_rolled_back_to() -> None:
    """Generation 2 rolls back to step 20: rank 2's write of step 30 was still under way.
    Then the abandoned run's step 30 reaches the scheduler from every rank: rank 2's writer
    ends that write while rank 2 puts step 20 back, and ranks 0 and 1, which discard their
    step 30 now, have not had their reports of what is left arrive. None of those lists was
    taken after its worker put step 20 back, so a generation decided now still rolls back to
    20, which every rank keeps, and not to 30, which the ranks are removing (the rule before:
    30; `tests/sim/putback.py`, seed 93 with 2 spares)."""
    clock = FakeClock()
    state = recovering(clock)
    for node_id, steps in (("0", [10, 20, 30]), ("1", [10, 20, 30]), ("2", [10, 20])):
        state.report_checkpoints(node_id, 1, steps, 1, seq=1)
    assert reform(state).rollback_step == 20
    state.report_checkpoints("2", 1, [10, 20, 30], 1, seq=2)  # listed before its put-back
    assert state.rollback_step() == 20
    assert reform(state).rollback_step == 20
    clock.advance(5)  # past the planner's reuse of its last answer
    assert state.held_by_all() == 20


def test_a_worker_counts_with_all_it_holds_once_it_says_it_put_the_step_back() -> None:
    """The steps a worker lists after it put back the generation's rollback step (and
    discarded the newer ones) are what it holds: the new run's, past that step, count."""
    clock = FakeClock()
    state = recovering(clock)
    all_report(state, [10, 20], 1)
    assert reform(state).rollback_step == 20
    for node_id in ("0", "1"):
        state.report_checkpoints(node_id, 1, [10, 20, 30], 2)
    state.report_checkpoints("2", 1, [10, 20, 30], 1)  # not put back yet
    assert state.rollback_step() == 20
    state.report_checkpoints("2", 1, [10, 20, 30], 2)
    assert state.rollback_step() == 30
    assert state.held_by_all() == 30  # no answer of a moment ago kept: it changed


def test_a_worker_that_says_it_put_the_step_back_is_saved_before_it_is_answered() -> None:
    """Whether a worker put back the rollback step decides what every worker keeps: a report
    that says so changes the state to save (revision), the same steps held or not."""
    state = recovering(FakeClock())
    all_report(state, [10, 20], 1)
    reform(state)
    revision = state.revision
    state.report_checkpoints("0", 1, [10, 20], 2)
    assert state.revision == revision + 1
    state.report_checkpoints("0", 1, [10, 20], 2)
    assert state.revision == revision + 1


def test_what_each_worker_put_back_is_restored_with_the_job() -> None:
    """A restarted scheduler knows which workers put the rollback step back: it plans the
    next rollback step as the one before it did; from a state saved without it, every worker
    is taken as not yet past the step it was told."""
    clock = FakeClock()
    state = recovering(clock)
    all_report(state, [10, 20], 1)
    reform(state)
    for node_id in ("0", "1"):
        state.report_checkpoints(node_id, 1, [10, 20, 30], 2)
    state.report_checkpoints("2", 1, [10, 20, 30], 1)
    saved = state.snapshot()
    restored = SchedulerState.restore(saved, state.settings, clock, new_cluster_id="job-2")
    assert restored.rollback_step() == 20
    restored.report_checkpoints("2", 1, [10, 20, 30], 2)
    assert restored.rollback_step() == 30
    older = {k: v for k, v in restored.snapshot().items() if k != "put_back"}
    again = SchedulerState.restore(older, state.settings, clock, new_cluster_id="job-3")
    assert again.rollback_step() == 20


def test_a_spare_takes_what_the_failed_worker_put_back_with_its_steps() -> None:
    """A spare that takes a failed rank takes the steps reported for it, and with them
    whether they were listed after the rollback step was put back."""
    clock = FakeClock()
    state = job(clock)
    for node_id in ("0", "1", "2"):
        state.report_checkpoints(node_id, 1, [10, 20], 1)
    (ready,) = ready_events(state.disconnect("2", 1))  # s0 takes rank 2 in generation 2
    assert ready.rollback_step == 20
    for node_id in ("0", "1", "s0"):
        state.report_checkpoints(node_id, 1, [10, 20, 30], 2)
    outcome, _ = state.register(spare_reg(state, "3", port=7001))
    assert isinstance(outcome, Accepted)
    state.connect("3", 1)
    (ready,) = ready_events(state.disconnect("s0", 1))  # "3" takes rank 2 in generation 3
    assert ready.rollback_step == 30


@pytest.mark.parametrize("put_back", [[], "0", 3, {"0": "two"}, {"0": None}])
def test_a_malformed_put_back_in_a_saved_state_is_a_snapshot_error(put_back: object) -> None:
    """A saved state whose `put_back` is not node ids to generations is refused as malformed,
    in words (a SnapshotError), not with a traceback."""
    clock = FakeClock()
    state = recovering(clock)
    all_report(state, [10, 20], 1)
    saved = {**state.snapshot(), "put_back": put_back}
    with pytest.raises(SnapshotError, match="the saved state is malformed"):
        SchedulerState.restore(saved, state.settings, clock, new_cluster_id="job-2")


def test_a_report_before_any_generation_changes_nothing_saved() -> None:
    """A worker of a job that never formed (here: failed waiting for the others) says it put
    back generation 0's step, which is as saying nothing: the saved state stays as it is, and
    its revision with it (found by the state machine's hypothesis test: a report that changed
    what is saved without a new revision, so a restart would not have had it)."""
    clock = FakeClock()
    state = make_state(clock, worker_num=1, server_num=1, topo_timeout_s=15.0)
    state.register(reg(state, "0", server_num=1))
    clock.advance(40.0)
    state.tick()
    assert state.phase is Phase.FAILED
    saved = state.snapshot()
    state.report_checkpoints("0", 1, [], 0, seq=1)
    assert state.snapshot() == saved
