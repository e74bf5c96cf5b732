"""Whose Finish answer a finished job still owes (`SchedulerState.owed_end`,
`cluster.scheduler.machine.finish_answers`), on the pure state with a fake clock.

A member whose stream closed between the count of its Finish and the answer never heard that
it counted: the finished job waits for it to ask again, up to MS_NODE_TIMEOUT from the loss,
and its registration, refused as the job finished, tells it that its finish counted. Members
that heard their answer, or the job's end on their stream, are owed nothing: a job whose
members all heard the end is not held."""

from __future__ import annotations

from cluster.protocol.records import Phase, Refusal
from cluster.scheduler.machine.state import SchedulerState
from tests.conftest import FakeClock
from tests.unit.test_state import SETTINGS, ready_state, refuse, reg


def finished(clock: FakeClock, *, lost: bool) -> SchedulerState:
    """A job of two whose rank 1 finishes last: its stream closes before its answer goes
    (`lost`), or after."""
    state = ready_state(clock, ["0", "1"])
    for node_id in ("0", "1"):
        state.connect(node_id, 1)
    state.finish("0", 1)
    state.finish_answered("0")
    state.disconnect("0", 1)  # it heard its answer, then closed its stream
    state.finish("1", 1)
    assert state.phase is Phase.FINISHED
    if lost:
        clock.advance(0.5)
        state.disconnect("1", 1)
        state.finish_answered("1")  # on a connection that is gone
    else:
        state.finish_answered("1")
        state.disconnect("1", 1)
    return state


def test_a_job_whose_members_heard_their_answers_owes_nobody() -> None:
    assert finished(FakeClock(), lost=False).owed_end() == {}


def test_a_finish_answer_lost_with_its_stream_is_owed_until_the_node_timeout() -> None:
    clock = FakeClock()
    state = finished(clock, lost=True)
    assert state.owed_end() == {"1": SETTINGS.node_timeout_s}
    clock.advance(4)
    assert state.owed_end() == {"1": SETTINGS.node_timeout_s - 4}
    clock.advance(SETTINGS.node_timeout_s - 4)
    assert state.owed_end() == {}


def test_its_registration_refused_as_the_job_finished_tells_it_that_its_finish_counted() -> None:
    state = finished(FakeClock(), lost=True)
    refusal = refuse(state, reg(state, "1"), Refusal.JOB_FINISHED)
    assert (
        refusal.message == "job job-1 finished (all 2 nodes finished); this node's finish counted"
    )
    assert state.owed_end() == {}


def test_the_jobs_end_handed_to_its_stream_tells_it() -> None:
    """The last finisher hears the end on its stream, and closes it before its answer goes."""
    state = ready_state(FakeClock(), ["0", "1"])
    for node_id in ("0", "1"):
        state.connect(node_id, 1)
        state.finish(node_id, 1)
    state.told_end("0")
    state.told_end("1")
    state.disconnect("0", 1)
    state.disconnect("1", 1)
    assert state.phase is Phase.FINISHED
    assert state.owed_end() == {}


def test_a_lost_answer_is_owed_only_once_the_job_finished() -> None:
    state = ready_state(FakeClock(), ["0", "1"])
    state.connect("1", 1)
    state.finish("1", 1)
    state.disconnect("1", 1)
    assert state.phase is Phase.READY
    assert state.owed_end() == {}  # it may come back and ask while the job runs
    state.connect("1", 1)  # back: its new stream will tell it the end
    state.finish("0", 1)
    assert state.owed_end() == {}


def test_a_failed_job_owes_no_finish_answer() -> None:
    state = ready_state(FakeClock(), ["0", "1"])
    state.connect("1", 1)
    state.finish("1", 1)
    state.disconnect("1", 1)
    state.connect("0", 1)
    state.disconnect("0", 1)  # dies: the job fails (recovery off)
    assert state.phase is Phase.FAILED
    assert state.owed_end() == {}
