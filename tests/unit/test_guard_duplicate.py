"""The guard's refusal names a node id given to two processes: a new process of a node id whose
holder is live right now (its stream open, heard within two heartbeat intervals) is most likely
a second process started with the same MS_NODE_ID, whose wait would be pushed back for as long as
the holder lives. It was told only "node id '1' was last seen alive 0.0 s ago ... (retry in
30.0 s)", again and again, until its MS_TOPO_TIMEOUT. A holder that stopped (SIGSTOP, hung),
whose stream broke, or that is not connected yet keeps the guard's usual refusal, and who is
admitted when is the same either way."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.records import Accepted, NodeState, Phase, Refusal
from cluster.scheduler.machine.state import SchedulerState
from tests.conftest import FakeClock
from tests.unit.test_state import accept, make_state, refuse, reg

DUPLICATE = "two processes of this job have the same MS_NODE_ID? give each its own"
USUAL = "node id '1' was last seen alive"


def holding(clock: FakeClock, *, connected: bool = True, **changes: object) -> SchedulerState:
    """A forming job of 2 workers whose node '1' is held by a process on h0:5000, incarnation 1,
    with its stream open (unless `connected` is false)."""
    state = make_state(clock, worker_num=2, **changes)
    accept(state, reg(state, "1"))
    if connected:
        state.connect("1", 1)
    return state


def test_a_second_process_beside_a_live_holder_is_told_the_id_is_given_twice() -> None:
    clock = FakeClock()
    state = holding(clock)
    clock.advance(0.2)
    newcomer = reg(state, "1", host="h1", port=5001, incarnation=2)
    refusal = refuse(state, newcomer, Refusal.NODE_ALIVE)
    assert refusal.message == (
        "node id '1' is held by a live process (at h0:5000, incarnation 1, heard 0.2 s ago), "
        "and this process (at h1:5001, incarnation 2) registers with it too: two processes of "
        "this job have the same MS_NODE_ID? give each its own; a restarted worker is taken once "
        "the old one has been silent for MS_NODE_TIMEOUT=10 s"
    )
    assert refusal.retry_after_s == pytest.approx(9.8)  # the guard's wait, as before
    # The holder beats on: each try is told the same, never a "retry in" that moves away.
    for _ in range(5):
        clock.advance(1.0)
        state.heartbeat("1", 1)
        refusal = refuse(state, newcomer, Refusal.NODE_ALIVE)
        assert DUPLICATE in refusal.message
        assert "heard 0.0 s ago" in refusal.message
        assert "retry in" not in refusal.message


def test_a_stopped_holder_keeps_the_usual_refusal_for_a_restarted_process() -> None:
    """The restart of a worker whose old process hangs (SIGSTOP): the old one is not heard, so
    the newcomer is told when the guard ends, and is taken then."""
    clock = FakeClock()
    state = holding(clock)
    clock.advance(2.5)  # over two heartbeat intervals of 1 s without a beat
    refusal = refuse(state, reg(state, "1", incarnation=2), Refusal.NODE_ALIVE)
    assert refusal.message.startswith(f"{USUAL} 2.5 s ago; the scheduler takes a new process")
    assert "(retry in 7.5 s)" in refusal.message
    assert DUPLICATE not in refusal.message
    clock.advance(7.5)
    accept(state, reg(state, "1", incarnation=2))
    assert state.members["1"].incarnation == 2


def test_a_holder_whose_stream_has_not_opened_keeps_the_usual_refusal() -> None:
    clock = FakeClock()
    state = holding(clock, connected=False)
    clock.advance(0.3)
    refusal = refuse(state, reg(state, "1", incarnation=2), Refusal.NODE_ALIVE)
    assert refusal.message.startswith(f"{USUAL} 0.3 s ago;"), refusal.message
    assert DUPLICATE not in refusal.message


def test_a_holder_whose_stream_broke_keeps_the_usual_refusal() -> None:
    """In a running job with recovery (while the job forms, a node whose stream breaks leaves
    it, and its id is free)."""
    clock = FakeClock()
    state = holding(clock, recovery=True)
    accept(state, reg(state, "0", port=5002))
    state.connect("0", 1)
    assert state.phase is Phase.READY
    state.disconnect("1", 1)
    assert state.members["1"].state is NodeState.FAILED
    refusal = refuse(state, reg(state, "1", incarnation=2), Refusal.NODE_ALIVE)
    assert refusal.message.startswith("node id '1' (failed) was last seen alive 0.0 s ago;")


@given(
    interval=st.sampled_from([0.1, 1.0, 2.0]),
    silent=st.floats(min_value=0.0, max_value=12.0, allow_nan=False),
    connected=st.booleans(),
)
def test_the_wording_follows_the_holder_and_the_guard_does_not(
    interval: float, silent: float, connected: bool
) -> None:
    """Whatever the holder's silence and stream: the newcomer is refused, with the guard's
    wait, exactly while the holder was heard within MS_NODE_TIMEOUT (10 s), and taken after;
    the refusal says the id is given twice exactly while the holder is live (stream open,
    heard within two heartbeat intervals)."""
    clock = FakeClock()
    state = holding(clock, connected=connected, heartbeat_interval_s=interval)
    clock.advance(silent)
    silent = clock.now - state.members["1"].last_seen  # as the clock's floats add up
    outcome, _ = state.register(reg(state, "1", incarnation=2))
    if silent >= 10.0:
        assert isinstance(outcome, Accepted)
        return
    assert not isinstance(outcome, Accepted)
    assert outcome.reason is Refusal.NODE_ALIVE
    assert abs(outcome.retry_after_s - (10.0 - silent)) < 1e-9
    live = connected and silent <= 2 * interval
    assert (DUPLICATE in outcome.message) is live, outcome.message
    assert outcome.message.startswith(USUAL) is not live, outcome.message
