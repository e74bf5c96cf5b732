"""Why a worker gave up registering, without a network (the core, an injected clock): the
scheduler's last refusal or held answer, and the address doubted only when nothing answered.

A node refused for its whole wait (its guard: the node id still alive elsewhere), or whose answer
the scheduler held (it could not save its state: a full disk), was told "is it running, and are
MS_SCHED_HOST / MS_SCHED_PORT right?", though the scheduler had answered every try."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given

from cluster.protocol.errors import SchedulerUnreachableError, TopologyTimeoutError
from cluster.worker.machine import steps
from cluster.worker.machine.core import WorkerCore
from tests.conftest import FakeClock
from tests.unit.test_worker_core import NODE_S, TOPO_S, accepted, config, fails, topology

ADDRESS_HINT = "MS_SCHED_HOST / MS_SCHED_PORT"
GUARD = "node id '0' was last seen alive 0.4 s ago; ... (retry in 2.6 s)"


def joining() -> tuple[WorkerCore, FakeClock]:
    clock = FakeClock()
    core = WorkerCore(config(), clock)
    assert [type(a) for a in core.step(steps.Start())] == [steps.Register]
    return core, clock


def refused_until_the_deadline(
    core: WorkerCore, clock: FakeClock, waits: list[float]
) -> list[steps.Action]:
    """Every try refused by the guard (the answer after each wait of `waits`, in turn), until
    the core gives up; what it did then."""
    for i in range(10_000):
        clock.now += waits[i % len(waits)]
        pause = core.step(steps.Refused(f"{GUARD} #{i}", transient=True, retry_after_s=2.6))[-1]
        assert isinstance(pause, steps.Pause)
        clock.now += pause.seconds
        actions = core.step(steps.PauseOver())
        if not any(isinstance(a, steps.Register) for a in actions):
            return actions
    raise AssertionError("the core never gave up")


@given(waits=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=5))
def test_a_node_refused_at_every_try_names_the_last_refusal_not_the_address(
    waits: list[float],
) -> None:
    core, clock = joining()
    (error,) = fails(refused_until_the_deadline(core, clock, waits))
    assert isinstance(error, TopologyTimeoutError)
    message = str(error)
    assert "did not accept this node in time: it refused this node for the whole wait" in message
    assert message.endswith(f"the last time because {core.answers.refusal}")
    assert core.answers.refusal.startswith(GUARD)
    assert ADDRESS_HINT not in message


def test_refusals_after_a_try_that_got_no_answer_are_the_last_ones_only() -> None:
    core, clock = joining()
    core.step(steps.Unanswered())
    core.step(steps.PauseOver())
    core.step(steps.Checked(ok=True))
    (error,) = fails(refused_until_the_deadline(core, clock, [1.0]))
    assert "it refused this node at its last " in str(error)
    assert "tries, over the last " in str(error)
    assert ADDRESS_HINT not in str(error)


def test_a_held_answer_until_the_deadline_names_the_hold() -> None:
    core, clock = joining()
    clock.now += TOPO_S
    said = core.step(steps.AnswerLate(TOPO_S))  # the attempt is given up at the deadline
    assert [type(a) for a in said] == [steps.Say]
    core.step(steps.Unanswered())
    (error,) = fails(core.step(steps.PauseOver()))
    assert isinstance(error, TopologyTimeoutError)
    assert (
        "did not accept this node in time: it took this node's registration but held its "
        f"answer for {TOPO_S:.0f} s: it answers once it has saved" in str(error)
    )
    assert "cannot save its state" in str(error)
    assert ADDRESS_HINT not in str(error)


def test_a_refusal_then_a_scheduler_found_down_names_why_it_is_down() -> None:
    core, clock = joining()
    core.step(steps.Refused(GUARD, transient=True, retry_after_s=2.6))
    core.step(steps.PauseOver())
    core.step(steps.Unanswered())
    core.step(steps.PauseOver())
    core.step(steps.Checked(ok=False, unreachable="nothing listens on port 8118"))
    clock.now += TOPO_S
    (error,) = fails(core.step(steps.PauseOver()))
    assert str(error).endswith("did not accept this node in time: nothing listens on port 8118")


def test_only_a_scheduler_that_never_answered_has_its_address_doubted() -> None:
    core, clock = joining()
    core.step(steps.Unanswered())
    clock.now += TOPO_S
    (error,) = fails(core.step(steps.PauseOver()))
    assert ADDRESS_HINT in str(error)


def test_a_refusal_before_the_stream_was_lost_is_not_the_reconnects() -> None:
    core, clock = joining()
    core.step(steps.Refused(GUARD, transient=True, retry_after_s=2.6))
    core.step(steps.PauseOver())
    core.step(accepted())
    core.step(steps.TopologyReady(topology()))
    core.step(steps.StreamLost("Socket closed"))
    clock.now += NODE_S
    (error,) = fails(core.step(steps.PauseOver()))
    assert isinstance(error, SchedulerUnreachableError)
    assert "is unreachable: Socket closed" in str(error)
    assert GUARD not in str(error)


def test_a_formed_node_whose_answer_is_held_is_told_so_not_that_it_is_unreachable() -> None:
    clock = FakeClock()
    core = WorkerCore(config(recovery=True), clock)
    core.step(steps.Start())
    core.step(accepted())
    core.step(steps.TopologyReady(topology()))
    core.step(steps.StreamLost("Socket closed"))
    clock.now += TOPO_S
    core.step(steps.AnswerLate(12.0))
    core.step(steps.Unanswered())
    (error,) = fails(core.step(steps.PauseOver()))
    assert isinstance(error, SchedulerUnreachableError)
    message = str(error)
    assert "did not take this node back within 60 s (the longer of" in message
    assert "(Socket closed): it took this node's registration but held its answer for 12 s" in (
        message
    )
    assert "is unreachable" not in message


def test_a_try_the_deadline_cut_off_on_its_way_leaves_the_refusals_named() -> None:
    """The node's last try, refused by the guard like every one before it, was made just
    before its deadline, which cut the call off a moment later: that is no answer held (the
    node said "held its answer for 0 s", and blamed a scheduler that cannot save)."""
    core, clock = joining()
    core.step(steps.Refused(GUARD, transient=True, retry_after_s=2.6))
    clock.now += TOPO_S - 0.1
    core.step(steps.PauseOver())
    clock.now += 0.1
    assert core.step(steps.AnswerLate(0.1)) == []  # said nothing of a hold
    core.step(steps.Unanswered())
    (error,) = fails(core.step(steps.PauseOver()))
    assert isinstance(error, TopologyTimeoutError)
    message = str(error)
    assert "did not accept this node in time: it refused this node " in message
    assert message.endswith(f"the last time because {GUARD}")
    assert "held its answer" not in message
