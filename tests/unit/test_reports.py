"""Checkpoint reports and what a node hears first, where a generation is decided but not yet
told (its save pending): rules the simulation (`tests/sim`) found wanting."""

from __future__ import annotations

from cluster.scheduler.machine.state import (
    Accepted,
    SchedulerState,
    TopologyReadyEvent,
)
from tests.unit.test_spares import GUARD, job, ready_events
from tests.unit.test_state import JOB, FakeClock, recovering, reg


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
