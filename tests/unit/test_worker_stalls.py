"""The worker core and this process's own stalls (`cluster.worker.machine.stalls`), without a
network: a stall is never the scheduler's silence, and a loss of the stream that follows a stall
long enough for the scheduler to fail this node says that this process was stopped or starved,
not that the scheduler was lost, silent or cut off."""

from __future__ import annotations

from cluster.protocol.errors import JobFailedError, SchedulerUnreachableError
from cluster.worker.machine import steps
from cluster.worker.machine.core import WorkerCore
from cluster.worker.machine.stalls import NAMED_WITHIN_S
from tests.conftest import FakeClock
from tests.unit.test_worker_core import NODE_S, accepted, config, fails, ready_core

OWN = "this process was stopped or starved for 40.0 s"
REMOVED = "node '0' was removed from the job: no heartbeat for 30.1 s"


def said(actions: list[steps.Action]) -> list[str]:
    return [action.text for action in actions if isinstance(action, steps.Say)]


def stalled(core: WorkerCore, clock: FakeClock, seconds: float) -> None:
    """This process does not run for `seconds`; its stall watch tells the core as it runs."""
    clock.advance(seconds)
    assert core.step(steps.Stalled(seconds)) == []


def test_the_schedulers_silence_does_not_count_this_processs_own_stall() -> None:
    core, clock = ready_core()
    heard_at = clock.now
    clock.advance(2.0)
    stalled(core, clock, 40.0)
    clock.advance(3.0)
    assert core.silence_left(heard_at, NODE_S) == NODE_S - 5.0
    clock.advance(NODE_S)
    assert core.silence_left(heard_at, NODE_S) <= 0  # silent while it ran: given up


def test_a_stall_before_the_stream_was_last_heard_does_not_count() -> None:
    core, clock = ready_core()
    stalled(core, clock, 40.0)
    heard_at = clock.now + 1.0
    clock.advance(NODE_S + 1.0)
    assert core.silence_left(heard_at, NODE_S) == 0.0


def test_a_job_not_formed_yet_is_not_held_to_the_schedulers_silence() -> None:
    clock = FakeClock()
    core = WorkerCore(config(), clock)
    core.step(steps.Start())
    core.step(accepted())
    heard_at = clock.now
    clock.advance(10 * NODE_S)
    assert core.silence_left(heard_at, NODE_S) == NODE_S


def test_a_loss_after_a_stall_past_the_limit_names_the_stall_not_the_scheduler() -> None:
    core, clock = ready_core(recovery=True)
    stalled(core, clock, 40.0)
    (line,) = said(core.step(steps.StreamLost(REMOVED)))
    assert line.startswith(f"{OWN} (SIGSTOP, a debugger, too little CPU"), line
    assert "the scheduler fails a node it does not hear for 30 s (MS_NODE_TIMEOUT)" in line
    assert f"then its event stream ended: {REMOVED}" in line
    assert "reconnecting to the scheduler at 127.0.0.1:8118 for up to 60 s" in line
    assert "lost the scheduler" not in line
    assert OWN in core.away()  # and while it reconnects


def test_without_recovery_a_loss_after_a_stall_names_it_in_the_error_too() -> None:
    core, clock = ready_core()
    stalled(core, clock, 40.0)
    (error,) = fails(core.step(steps.StreamLost("", silent_s=NODE_S)))
    assert isinstance(error, SchedulerUnreachableError)
    assert OWN in str(error)


def test_a_failed_job_names_this_processs_stall_with_the_schedulers_reason() -> None:
    core, clock = ready_core()
    stalled(core, clock, 40.0)
    (error,) = fails(core.step(steps.Shutdown(ok=False, reason="rank 0 died: no heartbeat")))
    assert isinstance(error, JobFailedError)
    assert str(error).startswith(f"job failed: rank 0 died: no heartbeat; {OWN}"), error


def test_a_stall_too_short_for_the_scheduler_to_fail_the_node_is_not_named() -> None:
    core, clock = ready_core(recovery=True)
    stalled(core, clock, NODE_S - 2.0)  # with a beat interval (1 s) before it: still heard
    (line,) = said(core.step(steps.StreamLost("connection reset")))
    assert line.startswith("lost the scheduler at 127.0.0.1:8118 (connection reset)"), line


def test_a_stall_long_over_is_not_named() -> None:
    core, clock = ready_core(recovery=True)
    stalled(core, clock, 40.0)
    clock.advance(NAMED_WITHIN_S + 1.0)
    (line,) = said(core.step(steps.StreamLost("connection reset")))
    assert "stopped or starved" not in line, line


def test_a_stall_says_nothing_of_the_schedulers_answers() -> None:
    """A stall between a registration's try cut off on its way and that try's end changes
    nothing in what the core keeps of the scheduler's answers (`Answers`)."""
    core, clock = ready_core()
    core.answers.cut_off = True
    stalled(core, clock, 2.0)
    assert core.answers.cut_off
