"""The worker core's decisions, without a network: each test is named after the rule it checks,
and a hypothesis rule-based machine drives the core as its agent would, checking the invariants
after every step (never both failed and ready; a fatal decision is final; no registration
attempt starts after its deadline; a finished node reports no failure)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cluster.protocol.backoff import (
    JITTER,
    LISTEN_FAST_S,
    LISTEN_SLOW_TRY_S,
    LISTEN_TRIES_PER_S,
    LISTEN_TRY_S,
    Draws,
    Spread,
    guard_poll_s,
    listen_every_s,
)
from cluster.protocol.config import ClusterConfig
from cluster.protocol.environment import from_env
from cluster.protocol.errors import (
    ClusterError,
    JobFailedError,
    RegistrationRefused,
    ReleasedError,
    SchedulerUnreachableError,
    TopologyTimeoutError,
)
from cluster.protocol.leader_search import DOWN_FOR_S
from cluster.protocol.records import GUARD_POLL_S
from cluster.protocol.topology import Topology
from cluster.worker.machine import steps
from cluster.worker.machine.core import FATAL_WAIT_S, TOPOLOGY_MARGIN_S, Lifecycle, WorkerCore
from cluster.worker.machine.finishing import FINISH_RETRIED, FINISH_TOO_LATE, HOLD_AGAIN_S
from cluster.worker.machine.pacing import (
    ATTEMPT_TIMEOUT_S,
    CALL_RETRY_PAUSE_S,
    FAILOVER_ATTEMPT_S,
    FINISH_RETRY,
    FINISH_SLACK_S,
    GUARD_MARGIN_S,
    RETRY_PAUSE_S,
)
from tests.conftest import FakeClock

TOPO_S = 60.0
NODE_S = 30.0


def config(
    *,
    recovery: bool = False,
    tmp: str = "/tmp/unused-recovery",
    hosts: str = "127.0.0.1",
    workers: int = 2,
) -> ClusterConfig:
    env = {
        "MS_ROLE": "MS_WORKER",
        "MS_WORKER_NUM": str(workers),
        "MS_SCHED_HOST": hosts,
        "MS_SCHED_PORT": "8118",
        "MS_TOPO_TIMEOUT": f"{TOPO_S:g}",
        "MS_NODE_TIMEOUT": f"{NODE_S:g}",
        "MS_NODE_ID": "0",
    }
    if recovery:
        env |= {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": tmp}
    return from_env(env)


def topology(generation: int = 1) -> Topology:
    table: Any = SimpleNamespace(node_ids=["0", "1"])
    return Topology(generation, 0, 0, 1, 2, table)


def accepted(generation: int = 1, rejoined: bool = False) -> steps.Accepted:
    return steps.Accepted("job-1", rejoined, generation, 1, 2, 1.0)


def kinds(actions: list[steps.Action]) -> list[type[Any]]:
    return [type(action) for action in actions]


def fails(actions: list[steps.Action]) -> list[ClusterError]:
    return [action.error for action in actions if isinstance(action, steps.Fail)]


class Middle:
    """Draws the middle of every range: each pause is its pace, for the tests of the paces
    (the jitter around them has its own)."""

    def uniform(self, a: float, b: float) -> float:
        return (a + b) / 2


MIDDLE = Middle()


def ready_core(
    *, recovery: bool = False, hosts: str = "127.0.0.1", draws: Draws | None = None
) -> tuple[WorkerCore, FakeClock]:
    clock = FakeClock()
    core = WorkerCore(config(recovery=recovery, hosts=hosts), clock, draws=draws)
    core.step(steps.Start())
    core.step(accepted())
    core.step(steps.TopologyReady(topology()))
    assert core.lifecycle is Lifecycle.READY
    return core, clock


# -- registering -------------------------------------------------------------------------------


def test_start_registers_at_once_and_is_bounded_by_MS_TOPO_TIMEOUT() -> None:
    clock = FakeClock()
    core = WorkerCore(config(), clock)
    (register,) = core.step(steps.Start())
    assert isinstance(register, steps.Register)
    assert register.answer_s == TOPO_S
    assert core.deadline == clock.now + TOPO_S
    assert core.ready_by == core.deadline + TOPOLOGY_MARGIN_S
    assert core.lifecycle is Lifecycle.JOINING


def test_an_unverified_scheduler_is_probed_before_the_first_attempt() -> None:
    core = WorkerCore(config(), FakeClock())
    assert kinds(core.step(steps.Start(verified=False))) == [steps.CheckScheduler]
    assert kinds(core.step(steps.Checked(ok=True))) == [steps.Register]


def test_a_direct_node_waits_for_the_scheduler_to_listen_then_registers() -> None:
    """Workers often start before their scheduler: a node that connects to it directly waits
    for its port (cheap tries, where gRPC backs off 100 ms at least), telling now and then why,
    until MS_TOPO_TIMEOUT, which names it."""
    clock = FakeClock()
    core = WorkerCore(config(), clock, draws=MIDDLE)
    # Every 10 ms for the first second of the wait, then as often as gRPC would have tried.
    first = steps.AwaitListening(LISTEN_FAST_S, LISTEN_TRY_S)
    assert core.step(steps.Start(direct=True)) == [first]
    refused = steps.ListeningAwaited(refused=True, why="connection refused")
    clock.now += LISTEN_FAST_S / 4
    assert core.step(refused) == [steps.AwaitListening(LISTEN_FAST_S * 3 / 4, LISTEN_TRY_S)]
    clock.now += LISTEN_FAST_S * 3 / 4
    assert core.step(refused) == [steps.AwaitListening(ATTEMPT_TIMEOUT_S, LISTEN_SLOW_TRY_S)]
    clock.now += ATTEMPT_TIMEOUT_S
    said = core.step(refused)
    assert kinds(said) == [steps.Say, steps.AwaitListening]
    assert "waiting for the scheduler at 127.0.0.1:8118: connection refused" in said[0].text
    assert kinds(core.step(refused)) == [steps.AwaitListening]  # said now and then, not each time
    assert kinds(core.step(steps.ListeningAwaited())) == [steps.Register]
    clock.now = core.deadline - 1.0
    assert core.step(refused)[-1] == steps.AwaitListening(1.0, LISTEN_SLOW_TRY_S)  # the deadline
    clock.now = core.deadline
    (error,) = fails(core.step(refused))
    assert isinstance(error, TopologyTimeoutError)
    assert "connection refused" in str(error)


def test_the_nodes_of_a_large_job_try_the_scheduler_port_less_often_each() -> None:
    """At most about LISTEN_TRIES_PER_S tries a second from the whole job."""
    core = WorkerCore(config(workers=20_000), FakeClock(), draws=MIDDLE)
    (wait,) = core.step(steps.Start(direct=True))
    assert isinstance(wait, steps.AwaitListening)
    assert wait.every_s == 20_000 / LISTEN_TRIES_PER_S


def guard_pauses(draws: Draws, workers: int) -> list[float]:
    """The pauses of a node refused by the guard (it clears in 25 s) until MS_TOPO_TIMEOUT:
    each within the guard's poll or clipped to the deadline, never past it."""
    clock = FakeClock()
    job = config(recovery=True, workers=workers)
    core = WorkerCore(job, clock, cluster_id="job-1", draws=draws)
    core.step(steps.Start())
    pauses: list[float] = []
    while core.lifecycle is Lifecycle.JOINING:
        pause = core.step(steps.Refused("node 0 is alive", transient=True, retry_after_s=25.0))[-1]
        assert isinstance(pause, steps.Pause)
        left = core.deadline - clock()
        assert pause.seconds <= left
        if pause.seconds < left:
            assert guard_poll_s(workers) / 2 <= pause.seconds <= guard_poll_s(workers)
            pauses.append(pause.seconds)
        clock.advance(pause.seconds)
        core.step(steps.PauseOver())
    return pauses


def port_waits(draws: Draws, workers: int) -> list[float]:
    """How far apart a direct node tries the port of a scheduler that does not listen (it
    restarts), until MS_TOPO_TIMEOUT: each within JITTER of the pace, never past the deadline;
    and its pause after an attempt that got no answer."""
    clock = FakeClock()
    core = WorkerCore(config(workers=workers), clock, draws=draws)
    start = clock()
    (wait,) = core.step(steps.Start(direct=True))
    paces: list[float] = []
    while isinstance(wait, steps.AwaitListening):
        left = core.deadline - clock()
        assert wait.timeout_s <= left
        assert wait.every_s <= left
        if wait.every_s < left:
            pace = listen_every_s(clock() - start, workers)
            assert pace * (1 - JITTER) <= wait.every_s <= pace * (1 + JITTER)
            paces.append(wait.every_s)
        clock.advance(wait.timeout_s)
        wait = core.step(steps.ListeningAwaited(refused=True, why="connection refused"))[-1]
    assert isinstance(wait, steps.Fail)
    again = WorkerCore(config(workers=workers), FakeClock(), draws=draws)
    again.step(steps.Start(direct=True))
    again.step(steps.ListeningAwaited())
    (pause,) = again.step(steps.Unanswered())
    assert isinstance(pause, steps.Pause)
    pace = max(RETRY_PAUSE_S, listen_every_s(LISTEN_FAST_S, workers))
    assert pace * (1 - JITTER) <= pause.seconds <= pace * (1 + JITTER)
    return [*paces, pause.seconds]


@pytest.mark.parametrize("workers", [2, 8_192])
def test_nodes_that_wait_together_try_apart(workers: int) -> None:
    """The scheduler and every worker start again together, or the scheduler alone: every node
    is refused by the guard with the same retry_after, or waits for the same port. Each of its
    pauses is drawn (around the pace; a guard's poll between half its ceiling and the
    ceiling, which grows with the job) from draws its shell seeds, so that the nodes' tries do
    not arrive together: two nodes seeded apart pause apart, one seeded alike pauses alike."""
    for pauses in (guard_pauses, port_waits):
        one, other = pauses(Spread(1), workers), pauses(Spread(2), workers)
        assert len(one) >= 5
        assert len(set(one)) > 1  # drawn each time
        assert all(a != b for a, b in zip(one, other, strict=False))
        assert pauses(Spread(1), workers) == one


def test_a_wait_for_the_port_ends_by_the_deadline_however_slow_its_pace() -> None:
    """A refused wait ends a pace after its last try; the last before MS_TOPO_TIMEOUT is paced
    to end by it, so that the timeout is reported when it passes, not up to a pace later."""
    clock = FakeClock()
    core = WorkerCore(config(workers=65_536), clock)
    core.step(steps.Start(direct=True))
    refused = steps.ListeningAwaited(refused=True, why="connection refused")
    clock.now = core.deadline - 10.0
    pace = core.step(refused)[-1]
    assert isinstance(pace, steps.AwaitListening)
    assert 1.0 < pace.every_s < 10.0
    clock.now = core.deadline - 0.5
    assert core.step(refused)[-1] == steps.AwaitListening(0.5, 0.5)


def test_only_a_direct_node_of_one_scheduler_waits_for_its_port() -> None:
    """Behind a relay the relay is there; with several schedulers a down one is passed over."""
    assert kinds(WorkerCore(config(), FakeClock()).step(steps.Start())) == [steps.Register]
    several = WorkerCore(config(hosts="127.0.0.1,127.0.0.2"), FakeClock())
    assert kinds(several.step(steps.Start(direct=True))) == [steps.Register]
    unverified = WorkerCore(config(), FakeClock())
    assert kinds(unverified.step(steps.Start(verified=False, direct=True))) == [
        steps.AwaitListening
    ]
    assert kinds(unverified.step(steps.ListeningAwaited())) == [steps.CheckScheduler]


def test_a_direct_node_that_lost_its_scheduler_waits_for_it_to_listen_again() -> None:
    clock = FakeClock()
    core = WorkerCore(config(recovery=True), clock)
    core.step(steps.Start(direct=True))
    core.step(steps.ListeningAwaited())
    core.step(accepted())
    core.step(steps.TopologyReady(topology()))
    assert kinds(core.step(steps.StreamLost("connection reset")))[-1] is steps.AwaitListening
    assert kinds(core.step(steps.ListeningAwaited())) == [steps.Register]


def test_an_unanswered_attempt_probes_the_scheduler_then_tries_again() -> None:
    core = WorkerCore(config(), FakeClock())
    core.step(steps.Start())
    assert kinds(core.step(steps.Unanswered())) == [steps.Pause]
    assert kinds(core.step(steps.PauseOver())) == [steps.CheckScheduler]
    assert kinds(core.step(steps.Checked(ok=False, unreachable="connection refused"))) == [
        steps.Pause
    ]


def test_a_relay_that_cannot_reach_the_scheduler_is_asked_again_not_probed_past() -> None:
    """An attempt the host's relay ended, unable to reach the scheduler, is made again through
    it after RETRY_PAUSE_S, whatever the job's size, with no probe of the scheduler (the relay
    waits for its port for the host); the wait says why, and so does a deadline passed."""
    clock = FakeClock()
    core = WorkerCore(config(workers=65_536), clock)
    core.step(steps.Start(direct=False))
    assert core.step(steps.Unanswered("connection refused")) == [steps.Pause(RETRY_PAUSE_S)]
    clock.now += 2.0
    assert kinds(core.step(steps.PauseOver())) == [steps.Register]
    said = core.step(steps.Unanswered("connection refused"))
    assert said[0] == steps.Say(
        "waiting for the scheduler at 127.0.0.1:8118: the relay cannot reach it "
        "(connection refused) (2 s)"
    )
    assert said[1:] == [steps.Pause(RETRY_PAUSE_S)]
    clock.now += TOPO_S
    (error,) = fails(core.step(steps.PauseOver()))
    assert "the relay cannot reach it (connection refused)" in str(error)


def test_a_relay_that_answered_a_registration_with_nothing_is_left_if_the_scheduler_answers() -> (
    None
):
    """A registration through the host's relay got no answer (the relay neither answered nor
    cut it off: stopped, its socket still taking connections) and the probe that follows finds
    the scheduler answering: the relay is lost, the node leaves it, naming it, and registers at
    once, directly (not again through the relay, until the deadline)."""
    core = WorkerCore(config(), FakeClock())
    core.step(steps.Start(direct=False))
    assert kinds(core.step(steps.Unanswered(relay="unix:/r.sock"))) == [steps.Pause]
    assert kinds(core.step(steps.PauseOver())) == [steps.CheckScheduler]
    left, register = core.step(steps.Checked(ok=True))
    assert left == steps.LeaveRelay(
        "it did not answer this node's registration, while the scheduler at 127.0.0.1:8118 answers"
    )
    assert isinstance(register, steps.Register)
    # Only then: a scheduler found down leaves the relay be (the silence may be the scheduler's),
    # and so does an attempt that went direct, or that the relay cut off.
    for relay, ok in (("unix:/r.sock", False), ("", True)):
        core.step(steps.Unanswered(relay=relay))
        core.step(steps.PauseOver())
        checked = steps.Checked(ok, "" if ok else "connection refused")
        assert not any(isinstance(a, steps.LeaveRelay) for a in core.step(checked))


@given(
    relay=st.sampled_from(["", "unix:/r.sock"]),
    cut_off=st.sampled_from(["", "connection refused"]),
    ok=st.booleans(),
)
def test_a_relay_is_left_only_when_it_answered_nothing_and_the_scheduler_answers(
    relay: str, cut_off: str, ok: bool
) -> None:
    core = WorkerCore(config(), FakeClock())
    core.step(steps.Start(direct=False))
    core.step(steps.Unanswered(cut_off, relay=relay))
    if kinds(core.step(steps.PauseOver())) == [steps.CheckScheduler]:  # (none after a cut-off)
        decided = core.step(steps.Checked(ok, "" if ok else "connection refused"))
        left = [a for a in decided if isinstance(a, steps.LeaveRelay)]
        assert bool(left) == (ok and bool(relay) and not cut_off)
    else:
        assert cut_off


def test_no_attempt_starts_after_MS_TOPO_TIMEOUT_and_the_failure_names_why() -> None:
    clock = FakeClock()
    core = WorkerCore(config(), clock)
    core.step(steps.Start())
    core.step(steps.Unanswered())
    core.step(steps.PauseOver())
    core.step(steps.Checked(ok=False, unreachable="nothing listens on port 8118"))
    clock.now += TOPO_S
    (error,) = fails(core.step(steps.PauseOver()))
    assert isinstance(error, TopologyTimeoutError)
    assert "nothing listens on port 8118" in str(error)
    assert core.lifecycle is Lifecycle.FAILED


def test_a_pause_never_outlasts_the_deadline() -> None:
    clock = FakeClock()
    core = WorkerCore(config(), clock)
    core.step(steps.Start())
    clock.now += TOPO_S - GUARD_POLL_S / 4  # (a guard's pause is half a poll at least)
    (said, pause) = core.step(steps.Refused("node 0 is alive", transient=True, retry_after_s=25))
    assert isinstance(said, steps.Say)
    assert isinstance(pause, steps.Pause)
    assert pause.seconds == pytest.approx(GUARD_POLL_S / 4)


def test_the_guard_refusal_is_retried_just_after_it_clears() -> None:
    core = WorkerCore(config(), FakeClock(), draws=MIDDLE)
    core.step(steps.Start())
    actions = core.step(steps.Refused("node 0 is alive", transient=True, retry_after_s=0.5))
    assert actions[-1] == steps.Pause(0.5 + GUARD_MARGIN_S)
    assert core.lifecycle is Lifecycle.JOINING


def test_a_node_waiting_out_its_guard_asks_again_often_enough_to_hear_the_jobs_end() -> None:
    clock = FakeClock()
    core = WorkerCore(config(recovery=True), clock, cluster_id="job-1")
    core.step(steps.Start())
    said, pause = core.step(steps.Refused("node 0 is alive", transient=True, retry_after_s=25.0))
    assert said == steps.Say("registration refused for now: node 0 is alive")
    assert isinstance(pause, steps.Pause)
    assert GUARD_POLL_S / 2 <= pause.seconds <= GUARD_POLL_S
    # The next refusals are said now and then, not at every attempt.
    assert kinds(core.step(steps.Refused("node 0 is alive", True, 24.0))) == [steps.Pause]
    actions = core.step(steps.Refused("job job-1 is over", finished=True))
    assert kinds(actions) == [steps.Released, steps.Done]
    assert isinstance(actions[0], steps.Released)
    assert isinstance(actions[0].error, ReleasedError)
    assert core.lifecycle is Lifecycle.FINISHED
    assert core.error is None


def spare_core() -> tuple[WorkerCore, FakeClock]:
    clock = FakeClock()
    core = WorkerCore(config(recovery=True), clock)
    core.step(steps.Start())
    actions = core.step(dataclasses.replace(accepted(), spare=True))
    assert kinds(actions) == [steps.Say, steps.Watch]
    assert core.lifecycle is Lifecycle.SPARE
    return core, clock


def test_a_spare_waits_without_a_deadline_until_a_topology_names_it() -> None:
    core, clock = spare_core()
    assert core.step(steps.Unplaced(1)) == []
    clock.now += TOPO_S * 10
    assert core.step(steps.DeadlinePassed()) == []
    actions = core.step(steps.TopologyReady(topology(2)))
    assert kinds(actions) == [steps.Say, steps.Deliver]
    assert "promoted" in actions[0].text  # type: ignore[union-attr]
    assert core.lifecycle is Lifecycle.READY


def test_a_spare_that_loses_its_scheduler_comes_back_as_a_spare() -> None:
    core, clock = spare_core()
    clock.now += TOPO_S * 10  # long after MS_TOPO_TIMEOUT: its reconnect window is still open
    actions = core.step(steps.StreamLost("connection reset"))
    assert kinds(actions) == [steps.Register]
    core.step(dataclasses.replace(accepted(), spare=True))
    assert core.lifecycle is Lifecycle.SPARE


def test_the_job_ending_while_a_node_is_a_spare_releases_it() -> None:
    core, _ = spare_core()
    actions = core.step(steps.Shutdown(True, "all 2 nodes finished"))
    assert kinds(actions) == [steps.Released, steps.Done]
    assert core.error is None


def test_a_job_failing_while_a_node_is_a_spare_fails_it() -> None:
    core, _ = spare_core()
    (error,) = fails(core.step(steps.Shutdown(False, "rank 1 died")))
    assert isinstance(error, JobFailedError)


def test_a_ranked_node_left_out_of_a_new_generation_fails() -> None:
    core, _ = ready_core(recovery=True)
    (error,) = fails(core.step(steps.Unplaced(2)))
    assert "went to a spare" in str(error)


def test_a_refusal_that_waiting_cannot_clear_fails_the_node() -> None:
    core = WorkerCore(config(), FakeClock())
    core.step(steps.Start())
    (error,) = fails(core.step(steps.Refused("MS_WORKER_NUM=3 does not match 2")))
    assert isinstance(error, RegistrationRefused)
    assert "MS_WORKER_NUM=3 does not match 2" in str(error)


def test_accepted_reads_the_stream_with_the_schedulers_heartbeat_interval() -> None:
    core = WorkerCore(config(), FakeClock())
    core.step(steps.Start())
    assert core.step(steps.Accepted("job-1", False, 1, 1, 2, 0.25)) == [steps.Watch(0.25)]
    assert core.lifecycle is Lifecycle.FORMING
    assert core.cluster_id == "job-1"


# -- the leader (issue #14) --------------------------------------------------------------------


def test_a_standby_is_left_for_the_leader_it_names_at_once() -> None:
    core = WorkerCore(config(), FakeClock())
    core.step(steps.Start())
    actions = core.step(steps.NotLeader("10.0.0.2:8118"))
    assert kinds(actions) == [steps.Say, steps.Follow, steps.Register]
    assert actions[1] == steps.Follow("10.0.0.2:8118")
    assert core.where == "the scheduler at 10.0.0.2:8118"


def test_a_standby_that_knows_no_leader_is_asked_again_after_a_pause() -> None:
    core = WorkerCore(config(), FakeClock())
    core.step(steps.Start())
    assert kinds(core.step(steps.NotLeader(""))) == [steps.Pause]


def test_a_formed_job_follows_a_new_leader_within_the_reconnect_window() -> None:
    core, clock = ready_core()
    actions = core.step(steps.NotLeader("10.0.0.2:8118"))
    assert steps.Follow("10.0.0.2:8118") in actions
    assert core.lifecycle is Lifecycle.RECONNECTING
    assert core.deadline == clock.now + NODE_S


@pytest.mark.parametrize("leader", ["127.0.0.2:8118", ""])
def test_a_spare_follows_a_new_leader_however_long_it_waited(leader: str) -> None:
    """A spare waits longer than MS_TOPO_TIMEOUT, as it may; when the leader hands the job
    over (or steps down, naming none yet), it registers again as a spare within a reconnect
    window from then. (It kept its start's deadline, and failed at once with a message that
    ended in nothing: "the scheduler at ... is unreachable: ".)"""
    clock = FakeClock()
    core = WorkerCore(config(hosts="127.0.0.1,127.0.0.2", recovery=True), clock)
    core.step(steps.Start())
    core.step(dataclasses.replace(accepted(), spare=True))
    clock.advance(TOPO_S + 100)
    actions = core.step(steps.NotLeader(leader, retry_after_s=0.5))
    assert fails(actions) == []
    assert core.lifecycle is Lifecycle.RECONNECTING
    assert core.deadline == clock() + NODE_S
    if not leader:  # no leader yet: the next address (probed first), after a pause
        assert actions == [steps.Follow("127.0.0.2:8118"), steps.Pause(0.5)]
        clock.advance(0.5)
        assert core.step(steps.PauseOver()) == [steps.CheckScheduler(FAILOVER_ATTEMPT_S)]
        actions = core.step(steps.Checked(True))
    assert actions[-1] == steps.Register(FAILOVER_ATTEMPT_S, core.deadline - clock())
    assert core.address == "127.0.0.2:8118"
    core.step(dataclasses.replace(accepted(), spare=True))
    assert core.lifecycle is Lifecycle.SPARE
    # Not back within the window: the failure says why.
    core.step(steps.NotLeader(""))
    clock.advance(NODE_S)
    (error,) = fails(core.step(steps.PauseOver()))
    assert str(error).endswith("is unreachable: the scheduler became a standby")


def test_several_addresses_are_tried_in_turn_when_one_is_down() -> None:
    core = WorkerCore(config(hosts="127.0.0.1,127.0.0.2"), FakeClock())
    assert core.address == "127.0.0.1:8118"
    assert kinds(core.step(steps.Start(verified=False))) == [steps.CheckScheduler]
    actions = core.step(steps.Checked(False, "connection refused"))
    assert actions[0] == steps.Follow("127.0.0.2:8118")
    assert kinds(actions[1:]) == [steps.Pause]
    assert kinds(core.step(steps.PauseOver())) == [steps.CheckScheduler]
    back = core.step(steps.Checked(False, "connection refused"))
    assert back[0] == steps.Follow("127.0.0.1:8118")


@pytest.mark.parametrize(("workers", "pause_s"), [(2, 0.1), (8_192, 0.8192), (65_536, 6.5536)])
def test_probes_of_unreachable_schedulers_keep_the_jobs_pace(workers: int, pause_s: float) -> None:
    """A node connected directly that finds no scheduler (several addresses, none up; an
    attempt unanswered) probes again after RETRY_PAUSE_S in a small job, and in a large one at
    its share of the job's LISTEN_TRIES_PER_S, as its waits for the port do: not 10 times a
    second each."""
    core = WorkerCore(
        config(hosts="127.0.0.1,127.0.0.2", workers=workers), FakeClock(), draws=MIDDLE
    )
    core.step(steps.Start(verified=False, direct=True))
    assert core.step(steps.Checked(False, "connection refused"))[1:] == [steps.Pause(pause_s)]
    assert core.step(steps.PauseOver()) == [steps.CheckScheduler(FAILOVER_ATTEMPT_S)]
    assert core.step(steps.Unanswered()) == [steps.Pause(pause_s)]
    assert pause_s == max(RETRY_PAUSE_S, workers / LISTEN_TRIES_PER_S)
    # Behind a relay, whose own waits for the port are paced for the host: RETRY_PAUSE_S.
    relayed = WorkerCore(config(workers=workers), FakeClock(), draws=MIDDLE)
    relayed.step(steps.Start(verified=False, direct=False))
    assert relayed.step(steps.Checked(False, "connection refused")) == [steps.Pause(RETRY_PAUSE_S)]


def test_a_standby_with_no_leader_sends_the_node_to_the_next_address() -> None:
    core = WorkerCore(config(hosts="127.0.0.1,127.0.0.2"), FakeClock())
    core.step(steps.Start())
    actions = core.step(steps.NotLeader("", retry_after_s=0.5))
    assert actions == [steps.Follow("127.0.0.2:8118"), steps.Pause(0.5)]


def test_a_leader_found_down_a_moment_ago_is_not_followed_back_at_once() -> None:
    core, clock = ready_core(recovery=True, hosts="127.0.0.1,127.0.0.2")
    # The leader (the first address) dies: the stream is lost, the probe finds it down.
    assert kinds(core.step(steps.StreamLost("connection reset")))[-1] is steps.CheckScheduler
    moved = core.step(steps.Checked(False, "connection refused"))
    assert moved[0] == steps.Follow("127.0.0.2:8118")
    core.step(steps.PauseOver())
    core.step(steps.Checked(True))
    # The standby still names the dead leader (its lease has not ended): it is asked again.
    actions = core.step(steps.NotLeader("127.0.0.1:8118", retry_after_s=0.5))
    assert actions == [steps.Pause(0.5)]
    assert core.address == "127.0.0.2:8118"
    clock.now += DOWN_FOR_S
    actions = core.step(steps.NotLeader("127.0.0.1:8118", retry_after_s=0.5))
    assert steps.Follow("127.0.0.1:8118") in actions
    assert kinds(actions)[-1] is steps.CheckScheduler  # probed first: it was down
    # Down still: the standby, which leads now, accepts the node; it stays there.
    core.step(steps.Checked(False, "connection refused"))
    core.step(steps.PauseOver())
    core.step(steps.Checked(True))
    assert kinds(core.step(accepted(2))) == [steps.Say, steps.Watch]
    assert core.address == "127.0.0.2:8118"


def test_a_named_leader_outside_the_list_is_followed() -> None:
    core = WorkerCore(config(hosts="sched-0,sched-1"), FakeClock())
    core.step(steps.Start())
    actions = core.step(steps.NotLeader("10.1.2.3:8118"))
    assert steps.Follow("10.1.2.3:8118") in actions
    # Found down later, it is left for the list, from its start.
    core.step(steps.Unanswered())
    core.step(steps.PauseOver())
    assert core.step(steps.Checked(False, "timed out"))[0] == steps.Follow("sched-0:8118")


# -- the stream --------------------------------------------------------------------------------


def test_the_topology_is_delivered_and_a_new_generation_is_said() -> None:
    core, _ = ready_core()
    actions = core.step(steps.TopologyReady(topology(2)))
    assert kinds(actions) == [steps.Say, steps.Deliver]
    deliver = actions[1]
    assert isinstance(deliver, steps.Deliver)
    assert deliver.new_generation


def test_only_a_failed_peer_of_the_current_generation_fails_its_collectives() -> None:
    core, _ = ready_core(recovery=True)
    assert steps.PeerFailed(1) in core.step(steps.NodeFailed(1, "1", "killed", 1))
    assert kinds(core.step(steps.NodeFailed(1, "1", "killed", 0))) == [steps.Say]


def test_a_failed_job_fails_the_node_and_ends_the_stream() -> None:
    core, _ = ready_core()
    actions = core.step(steps.Shutdown(ok=False, reason="rank 1 died"))
    assert kinds(actions) == [steps.Fail, steps.Done]
    (error,) = fails(actions)
    assert isinstance(error, JobFailedError)
    assert "rank 1 died" in str(error)


def test_without_recovery_a_silent_scheduler_fails_a_formed_node_at_once() -> None:
    core, _ = ready_core()
    (error,) = fails(core.step(steps.StreamLost("", silent_s=NODE_S)))
    assert isinstance(error, SchedulerUnreachableError)
    assert "no heartbeat" in str(error)


def test_a_broken_stream_is_reconnected_within_MS_NODE_TIMEOUT() -> None:
    core, clock = ready_core()
    actions = core.step(steps.StreamLost("connection reset"))
    assert kinds(actions) == [steps.Say, steps.Register]
    assert core.lifecycle is Lifecycle.RECONNECTING
    assert core.deadline == clock.now + NODE_S
    core.step(steps.Unanswered())
    clock.now += NODE_S
    (error,) = fails(core.step(steps.PauseOver()))
    assert isinstance(error, SchedulerUnreachableError)
    assert "did not come back within MS_NODE_TIMEOUT=30 s" in str(error)


def test_with_recovery_the_reconnect_window_is_the_longer_timeout() -> None:
    core, clock = ready_core(recovery=True)
    actions = core.step(steps.StreamLost("", silent_s=NODE_S))
    assert fails(actions) == []
    assert core.deadline == clock.now + max(NODE_S, TOPO_S)


def test_with_recovery_a_scheduler_not_back_is_failed_naming_the_window_it_had() -> None:
    """The window waited is MS_TOPO_TIMEOUT's here (60 s), not MS_NODE_TIMEOUT's (30 s), and
    the error says what brings the scheduler back."""
    core, clock = ready_core(recovery=True)
    core.step(steps.StreamLost("connection reset"))
    core.step(steps.Unanswered())
    clock.now += TOPO_S
    (error,) = fails(core.step(steps.PauseOver()))
    assert isinstance(error, SchedulerUnreachableError)
    assert str(error) == (
        "the scheduler at 127.0.0.1:8118 is unreachable: connection reset, and it did not come "
        "back within 60 s (the longer of MS_NODE_TIMEOUT and MS_TOPO_TIMEOUT, recovery on): to "
        "go on, start the scheduler again on the job's saved state (the same MS_RECOVERY_PATH "
        "or CLUSTER_STATE_URL) and this worker with it; a larger MS_TOPO_TIMEOUT waits longer"
    )


def test_while_the_scheduler_is_away_a_call_is_told_how_long_it_is_waited_for() -> None:
    """What a call whose own deadline passes meanwhile says (`WorkerCore.away`); nothing while
    the node is with its scheduler."""
    core, clock = ready_core(recovery=True)
    assert core.away() == ""
    core.step(steps.StreamLost("connection reset"))
    clock.now += 20
    assert core.away() == (
        "the scheduler at 127.0.0.1:8118 is away (connection reset), and this node waits 40 s "
        "more for it, 60 s (the longer of MS_NODE_TIMEOUT and MS_TOPO_TIMEOUT, recovery on) in "
        "all: start it again on the job's saved state (the same MS_RECOVERY_PATH or "
        "CLUSTER_STATE_URL) within that time, and the workers go on"
    )
    core.step(accepted())
    assert core.away() == ""


def test_a_silence_beyond_a_relay_that_answers_is_said_so_and_waited_out_through_it() -> None:
    """The scheduler silent while the relay the stream went through answers (the agent marks
    the silence with it): the node says the silence is beyond the relay and registers again
    through it; without recovery it fails, saying the same."""
    core, _ = ready_core(recovery=True)
    silent = steps.StreamLost("", silent_s=2.0, relay="unix:/r.sock")
    said, *then = core.step(silent)
    assert said == steps.Say(
        "lost the scheduler at 127.0.0.1:8118 (no heartbeat from the scheduler at "
        "127.0.0.1:8118 for 2 s through the relay at unix:/r.sock, which answers: the scheduler "
        "hung, or the relay's link to it is cut); training goes on (recovery is on), "
        f"reconnecting through the relay for up to {TOPO_S:g} s"
    )
    assert kinds(then) == [steps.Register]
    core, _ = ready_core()
    (error,) = fails(core.step(silent))
    assert "through the relay at unix:/r.sock, which answers" in str(error)


@pytest.mark.parametrize("recovery", [True, False], ids=["recovery", "no recovery"])
def test_a_node_that_loses_its_stream_while_finishing_says_it_waits_for_the_answer(
    recovery: bool,
) -> None:
    """Its training is over: it reconnects to hear whether its Finish counted, not to train."""
    core, _ = ready_core(recovery=recovery)
    core.step(steps.FinishSent())
    said, *_ = core.step(steps.StreamLost("connection reset"))
    bound = f"{TOPO_S:g} s" if recovery else f"MS_NODE_TIMEOUT={NODE_S:g} s"
    assert said == steps.Say(
        "lost the scheduler at 127.0.0.1:8118 (connection reset); this node finished: "
        f"reconnecting for up to {bound} to hear whether the scheduler counted its finish"
    )


def test_back_after_a_reconnect_the_node_is_ready_again() -> None:
    core, _ = ready_core()
    core.step(steps.StreamLost("connection reset"))
    actions = core.step(accepted(rejoined=True, generation=2))
    assert kinds(actions) == [steps.Say, steps.Watch]
    assert core.lifecycle is Lifecycle.READY


def test_the_job_that_did_not_form_by_the_deadline_fails_the_node() -> None:
    clock = FakeClock()
    core = WorkerCore(config(), clock)
    core.step(steps.Start())
    core.step(accepted())
    core.step(steps.Progress(1, 2))
    assert core.step(steps.DeadlinePassed()) == []  # too early: nothing
    clock.now = core.ready_by
    (error,) = fails(core.step(steps.DeadlinePassed()))
    assert isinstance(error, TopologyTimeoutError)
    assert "1 of 2 nodes had registered" in str(error)


# -- the end -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shutdown_first", [True, False])
def test_the_order_of_finish_heard_and_a_failed_jobs_shutdown_does_not_matter(
    shutdown_first: bool,
) -> None:
    """A rank that leaves early: its Finish is heard, and the job it left fails; the stream's
    Shutdown may arrive before the Finish's answer (the intermittent failure of
    test_a_rank_that_leaves_early_fails_the_collective_it_skips)."""
    core, _ = ready_core()
    core.step(steps.FinishSent())
    shutdown = steps.Shutdown(ok=False, reason="rank 1 failed")
    if shutdown_first:
        assert fails(core.step(shutdown)) == []
        assert fails(core.step(steps.FinishAnswered(heard=True))) == []
    else:
        assert fails(core.step(steps.FinishAnswered(heard=True))) == []
        assert fails(core.step(shutdown)) == []
    assert core.lifecycle is Lifecycle.FINISHED
    assert core.error is None


def test_a_failure_held_while_finish_was_on_its_way_is_reported_if_it_was_not_heard() -> None:
    core, _ = ready_core()
    core.step(steps.FinishSent())
    assert fails(core.step(steps.Shutdown(ok=False, reason="rank 1 failed"))) == []
    actions = core.step(steps.FinishAnswered(heard=False, details="UNAVAILABLE"))
    (error,) = fails(actions)
    assert isinstance(error, JobFailedError)
    assert core.lifecycle is Lifecycle.FAILED


def test_a_finished_node_neither_reconnects_nor_reports_a_lost_scheduler() -> None:
    core, _ = ready_core()
    core.step(steps.Shutdown(ok=True, reason="done"))
    assert core.step(steps.StreamLost("", silent_s=NODE_S)) == [steps.Done()]
    assert core.lifecycle is Lifecycle.FINISHED


def test_a_call_cut_off_is_made_again_with_recovery_and_fails_with_the_streams_reason_without() -> (
    None
):
    core, _ = ready_core(recovery=True)
    assert kinds(core.step(steps.CallCutOff())) == [steps.RetryCall]
    core, _ = ready_core()
    assert kinds(core.step(steps.CallCutOff())) == [steps.AwaitFatal]


# -- the finish and call retries ---------------------------------------------------------------

CODES = ["UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED", "INTERNAL", "ABORTED"]


def finishing_core(*, recovery: bool = False) -> tuple[WorkerCore, FakeClock, float]:
    """A formed job's core whose Finish was just sent; when it gives the Finish up."""
    core, clock = ready_core(recovery=recovery)
    (send,) = core.step(steps.FinishSent())
    assert send == steps.SendFinish(core.finish_wait_s)
    return core, clock, clock() + core.finish_wait_s


def test_a_finish_waits_up_to_the_node_timeout_and_its_slack() -> None:
    core, _, _ = finishing_core()
    assert core.finish_wait_s == max(NODE_S, FINISH_SLACK_S) + FINISH_SLACK_S


def test_no_finish_is_sent_by_a_node_that_never_joined_or_failed() -> None:
    core = WorkerCore(config(), FakeClock())
    core.step(steps.Start())
    assert core.step(steps.FinishSent()) == []  # no job to tell
    core, _ = ready_core()
    core.step(steps.Fatal(ClusterError("gone")))
    assert core.step(steps.FinishSent()) == []
    assert not core.finish_heard


def test_a_released_spare_sends_no_finish() -> None:
    core = WorkerCore(config(), FakeClock())
    core.step(steps.Start())
    core.step(dataclasses.replace(accepted(), spare=True))
    assert kinds(core.step(steps.Shutdown(ok=True, reason="done"))) == [steps.Released, steps.Done]
    assert core.step(steps.FinishSent()) == []


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("stream_up", [True, False])
def test_a_finish_is_sent_again_only_when_it_never_reached_a_scheduler_still_there(
    code: str, stream_up: bool
) -> None:
    """gRPC keeps an abandoned call queued at the scheduler: a Finish that reached it (a
    deadline, an error) is not made again, nor one whose node lost its stream."""
    core, _, _ = finishing_core()
    actions = core.step(steps.FinishFailed(code, "details", stream_up=stream_up))
    if code == FINISH_TOO_LATE:
        assert kinds(actions) == [steps.Fail]  # refused: see the test below
    elif code in FINISH_RETRIED and stream_up:
        assert actions == [steps.RetryFinish(FINISH_RETRY.first_s)]
    else:
        assert actions == [
            steps.Say(
                "could not tell the scheduler at 127.0.0.1:8118 that this node finished: details"
            )
        ]
        assert core.step(steps.FinishRetryDue()) == []  # given up: nothing more is sent


TOO_LATE = "job failed: rank 1 (node '1' at h:1) died: ...; this node's finish came after that"


@pytest.mark.parametrize("recovery", [False, True])
@pytest.mark.parametrize("stream_up", [True, False])
def test_a_finish_refused_as_the_job_failed_before_it_came_fails_the_node(
    recovery: bool, stream_up: bool
) -> None:
    """The scheduler counts no Finish of a failed job: refused with the job's failure (its
    node cut off, it never heard the Shutdown), the node fails with that, never exiting 0 as
    finished. A failure held while the Finish was on its way (the Shutdown heard meanwhile)
    is the one reported."""
    core, _, _ = finishing_core(recovery=recovery)
    if not stream_up:
        core.step(steps.StreamLost("Socket closed"))
    (error,) = fails(core.step(steps.FinishFailed(FINISH_TOO_LATE, TOO_LATE, stream_up=stream_up)))
    assert isinstance(error, JobFailedError)
    assert str(error) == TOO_LATE
    assert core.lifecycle is Lifecycle.FAILED
    assert not core.finish_heard
    assert core.step(steps.FinishRetryDue()) == []
    core, _, _ = finishing_core(recovery=recovery)
    assert fails(core.step(steps.Shutdown(ok=False, reason="rank 1 failed"))) == []
    (error,) = fails(core.step(steps.FinishFailed(FINISH_TOO_LATE, TOO_LATE, stream_up=True)))
    assert str(error) == "job failed: rank 1 failed"


def test_the_finish_pauses_double_up_to_their_ceiling_and_end_at_the_give_up_time() -> None:
    core, clock, give_up = finishing_core()
    pauses: list[float] = []
    while True:
        actions = core.step(steps.FinishFailed("UNAVAILABLE", "down", stream_up=True))
        if kinds(actions) != [steps.RetryFinish]:
            break
        (retry,) = actions
        assert isinstance(retry, steps.RetryFinish)
        assert clock() + retry.after_s < give_up  # never past the give-up time
        pauses.append(retry.after_s)
        clock.advance(retry.after_s)
        (send,) = core.step(steps.FinishRetryDue())
        assert send == steps.SendFinish(pytest.approx(give_up - clock()))
    assert kinds(actions) == [steps.Say]
    assert pauses[:5] == [0.1, 0.2, 0.4, 0.8, 1.6]
    assert set(pauses[5:]) == {FINISH_RETRY.max_s}
    assert give_up - clock() <= FINISH_RETRY.max_s
    assert not core.finish_heard


@settings(max_examples=200, deadline=None)
@given(
    failures=st.lists(
        st.tuples(st.sampled_from(CODES), st.booleans(), st.floats(0.0, 12.0)), max_size=40
    )
)
def test_a_finish_is_never_sent_past_its_give_up_time(
    failures: list[tuple[str, bool, float]],
) -> None:
    """Whatever its calls meet, a Finish is sent again only after a failure that never reached
    the scheduler, with the stream up, before the give-up time, after a pause that grows."""
    core, clock, give_up = finishing_core()
    last_pause = 0.0
    for code, stream_up, took_s in failures:
        clock.advance(took_s)
        actions = core.step(steps.FinishFailed(code, "x", stream_up=stream_up))
        if kinds(actions) != [steps.RetryFinish]:
            assert kinds(actions) == ([steps.Fail] if code == FINISH_TOO_LATE else [steps.Say])
            assert core.step(steps.FinishRetryDue()) == []
            return
        (retry,) = actions
        assert isinstance(retry, steps.RetryFinish)
        assert code in FINISH_RETRIED
        assert stream_up
        assert clock() + retry.after_s < give_up
        assert retry.after_s >= last_pause
        last_pause = retry.after_s
        clock.advance(retry.after_s)
        (send,) = core.step(steps.FinishRetryDue())
        assert isinstance(send, steps.SendFinish)
        assert 0 < send.timeout_s <= core.finish_wait_s


def test_a_finish_that_ran_out_of_time_with_recovery_names_the_schedulers_saves() -> None:
    core, clock, _ = finishing_core(recovery=True)
    clock.advance(core.finish_wait_s)
    (said,) = core.step(steps.FinishFailed("DEADLINE_EXCEEDED", "Deadline Exceeded"))
    assert isinstance(said, steps.Say)
    assert f"did not confirm within {core.finish_wait_s:g} s" in said.text
    assert "MS_RECOVERY_PATH" in said.text


def test_a_failure_held_while_the_finish_is_sent_again_waits_for_its_last_answer() -> None:
    core, clock, _ = finishing_core()
    assert fails(core.step(steps.Shutdown(ok=False, reason="rank 1 failed"))) == []
    (retry,) = core.step(steps.FinishFailed("UNAVAILABLE", "down", stream_up=True))
    assert isinstance(retry, steps.RetryFinish)
    clock.advance(retry.after_s)
    core.step(steps.FinishRetryDue())
    (error,) = fails(core.step(steps.FinishFailed("UNAVAILABLE", "down", stream_up=False)))
    assert isinstance(error, JobFailedError)
    # The owner's cancellation after that changes nothing: the answer was had.
    assert core.step(steps.FinishAnswered(heard=False, details="cancelled")) == []


def test_a_finish_heard_after_being_sent_again_finishes_the_node() -> None:
    core, clock, _ = finishing_core()
    (retry,) = core.step(steps.FinishFailed("CANCELLED", "cut off", stream_up=True))
    assert isinstance(retry, steps.RetryFinish)
    clock.advance(retry.after_s)
    core.step(steps.FinishRetryDue())
    assert core.step(steps.FinishAnswered(heard=True)) == []
    assert core.finish_heard
    assert core.lifecycle is Lifecycle.FINISHED


def held_finish_core() -> tuple[WorkerCore, FakeClock, float]:
    """With recovery, a formed job's node that finishes while its scheduler restarts: the
    Finish fails at once (nothing listens), its stream is down, it registers again; the end of
    its reconnect window."""
    core, clock = ready_core(recovery=True)
    core.step(steps.StreamLost("Socket closed"))
    assert core.lifecycle is Lifecycle.RECONNECTING
    window_end = core.deadline
    assert window_end == clock() + max(NODE_S, TOPO_S)
    clock.advance(0.5)
    assert kinds(core.step(steps.FinishSent())) == [steps.SendFinish]
    clock.advance(0.01)
    actions = core.step(steps.FinishFailed("UNAVAILABLE", "connection refused", stream_up=False))
    assert actions[1:] == [steps.HoldFinish(pytest.approx(window_end - clock()))]
    assert isinstance(actions[0], steps.Say)
    assert "this node's finish waits for it to take this node back, up to " in actions[0].text
    assert "as long as a training node waits for it (recovery is on)" in actions[0].text
    return core, clock, window_end


def test_with_recovery_a_finish_is_held_while_the_scheduler_restarts_and_sent_once_back() -> None:
    """The Finish of a node whose scheduler is restarting is not given up (the process would
    exit 0 and the restarted scheduler fail the job though every rank finished): it waits for
    the node's next acceptance, as long as a training node waits for its scheduler (far past
    the Finish's own give-up time), then goes, with its give-up time afresh."""
    core, clock, window_end = held_finish_core()
    clock.advance(core.finish_wait_s + 5.0)
    assert clock() < window_end
    # Woken before the node is back: held on, for what is left of the window.
    assert core.step(steps.FinishRetryDue()) == [
        steps.HoldFinish(pytest.approx(window_end - clock()))
    ]
    assert not core.over
    assert kinds(core.step(accepted())) == [steps.Say, steps.Watch]
    assert core.step(steps.FinishRetryDue()) == [steps.SendFinish(core.finish_wait_s)]
    assert core.step(steps.FinishAnswered(heard=True)) == []
    assert core.finish_heard
    assert core.lifecycle is Lifecycle.FINISHED
    assert core.finish_bound_s == 2 * core.finish_wait_s + max(NODE_S, TOPO_S)


def test_a_finish_that_timed_out_as_the_stream_was_lost_is_held_not_given_up() -> None:
    """A Finish whose answer did not come in time while the node lost its stream (a partition
    cut both) never reached the scheduler, or did and counts once: it is held for the node's
    return, not given up with a word about the scheduler's disk. With the stream up, the
    scheduler took it and has not saved it: given up, saying so."""
    core, _ = ready_core(recovery=True)
    core.step(steps.StreamLost("no heartbeat from the scheduler for 30 s"))
    core.step(steps.FinishSent())
    actions = core.step(steps.FinishFailed("DEADLINE_EXCEEDED", "deadline", stream_up=False))
    assert kinds(actions) == [steps.Say, steps.HoldFinish]
    assert "this node's finish waits for it to take this node back" in actions[0].text
    assert kinds(core.step(accepted())) == [steps.Say, steps.Watch]
    assert core.step(steps.FinishRetryDue()) == [steps.SendFinish(core.finish_wait_s)]
    core, _, _ = finishing_core(recovery=True)
    (said,) = core.step(steps.FinishFailed("DEADLINE_EXCEEDED", "deadline", stream_up=True))
    assert isinstance(said, steps.Say)
    assert "did not confirm within" in said.text


UNKNOWN = "the scheduler at 127.0.0.1:8118 did not answer whether it counted this node's finish"


def failed_unknown(actions: list[steps.Action]) -> str:
    """`actions` say that whether the scheduler counted the held finish is unknown, and fail
    the node with an unreachable scheduler, saying so: that error's text."""
    said, fail = actions
    assert said == steps.Say(UNKNOWN)
    assert isinstance(fail, steps.Fail)
    assert isinstance(fail.error, SchedulerUnreachableError)
    assert str(fail.error).startswith(
        f"{UNKNOWN} before it went away, so this worker cannot know whether the job finished: "
        'if it did (the scheduler\'s log ends with "job finished"), nothing is lost; if not, '
        "the scheduler at 127.0.0.1:8118 is unreachable: "
    )
    return str(fail.error)


def test_a_held_finish_ends_with_the_reconnect_window_as_the_node_fails() -> None:
    """Not back within its reconnect window: the node fails as a training node does (its
    process exits non-zero, saying to start the scheduler again and this worker with it). The
    scheduler may have counted the finish and ended the job before it went: the failure says
    that this is what is unknown, not that telling it failed."""
    core, clock, window_end = held_finish_core()
    clock.now = window_end
    assert core.step(steps.FinishRetryDue()) == [steps.HoldFinish(HOLD_AGAIN_S)]
    error = failed_unknown(core.step(steps.PauseOver()))  # its registering again gives up
    assert "and it did not come back within 60 s" in error
    assert "start the scheduler again" in error
    assert core.lifecycle is Lifecycle.FAILED
    assert not core.finish_heard
    assert core.step(steps.FinishRetryDue()) == []  # given up: nothing more is sent


def test_a_failure_while_the_finish_is_held_ends_the_hold_and_is_reported() -> None:
    core, _, _ = held_finish_core()
    said, fail = core.step(steps.Refused("node 0 belongs to job job-1, but this runs job-2"))
    assert said == steps.Say(UNKNOWN)
    assert isinstance(fail, steps.Fail)
    assert isinstance(fail.error, RegistrationRefused)
    assert core.lifecycle is Lifecycle.FAILED
    assert core.step(steps.FinishRetryDue()) == []


@pytest.mark.parametrize("held", [True, False])
def test_a_job_that_finished_while_the_finish_was_held_or_on_its_way_heard_it(held: bool) -> None:
    """A Finish that reached the scheduler before the connection broke may have ended the job:
    the restarted scheduler refuses the node for a finished job, which every finish, this one
    too, made so. Not a failure: the node exits 0."""
    if held:
        core, _, _ = held_finish_core()
    else:  # on its way, sent again after a pause, when the stream was lost
        core, _, _ = finishing_core(recovery=True)
        (retry,) = core.step(steps.FinishFailed("UNAVAILABLE", "down", stream_up=True))
        assert isinstance(retry, steps.RetryFinish)
        core.step(steps.StreamLost("Socket closed"))
    actions = core.step(steps.Refused("job job-1 is over (finished: done)", finished=True))
    assert actions == [
        steps.Say("the job finished: job job-1 is over (finished: done)"),
        steps.Done(),
    ]
    assert core.finish_heard
    assert core.lifecycle is Lifecycle.FINISHED
    assert core.error is None
    assert core.step(steps.FinishRetryDue()) == []


def test_a_held_finish_that_the_schedulers_saved_state_shows_counted_is_heard() -> None:
    """The scheduler counted the Finish, ended the job and went before its answer came: its
    saved state, read by the agent while the Finish is held, says so. The node is done (exit
    0, its record saved as finished), and its registering again stops without a word."""
    core, clock, window_end = held_finish_core()
    evidence = "its saved state (/r/scheduler.json) lists this node's finish as counted"
    said, done = core.step(steps.FinishCounted(evidence))
    assert said == steps.Say(
        f"the scheduler at 127.0.0.1:8118 went away without answering this node's finish, but "
        f"{evidence} (it saves a finish before it answers): this node is done"
    )
    assert done == steps.Done()
    assert core.finish_heard
    assert core.lifecycle is Lifecycle.FINISHED
    assert core.step(steps.FinishRetryDue()) == []
    assert core.step(steps.ListeningAwaited(refused=True, why="connection refused")) == []
    assert core.step(steps.Unanswered()) == []
    assert core.step(steps.Checked(ok=False, unreachable="connection refused")) == []
    clock.now = window_end
    assert core.step(steps.PauseOver()) == []  # the window's end fails nothing
    assert core.error is None
    assert core.step(steps.FinishCounted(evidence)) == []  # heard already: said once


@pytest.mark.parametrize("recovery", [False, True])
@pytest.mark.parametrize("code", ["UNAVAILABLE", "DEADLINE_EXCEEDED"])
def test_a_finish_whose_answer_is_lost_after_the_jobs_end_was_heard_is_heard(
    recovery: bool, code: str
) -> None:
    """The stream told the job's end (every rank's finish counted, this one's too) and then
    broke before the Finish's own answer came: the Finish was heard, and nothing is said of
    a Finish not told or of the scheduler's saves."""
    core, _, _ = finishing_core(recovery=recovery)
    assert core.step(steps.Shutdown(ok=True, reason="all 2 nodes finished")) == [steps.Done()]
    assert core.step(steps.FinishFailed(code, "Socket closed", stream_up=False)) == []
    assert core.finish_heard
    assert core.lifecycle is Lifecycle.FINISHED
    assert core.error is None


FinishWait = steps.SendFinish | steps.RetryFinish | steps.HoldFinish


def assert_within(action: FinishWait, now: float, give_up: float, window_end: float) -> None:
    """A Finish is never sent nor paused for past its give-up time, nor held past the end of
    the node's reconnect window (but for a hold woken there, which the node's failure ends)."""
    wait_s = action.after_s if isinstance(action, steps.RetryFinish) else action.timeout_s
    assert wait_s > 0
    if isinstance(action, steps.HoldFinish):
        assert now + wait_s <= window_end + 1e-9 or wait_s == HOLD_AGAIN_S
    else:
        assert now + wait_s <= give_up + 1e-9


FINISH_LIFE = st.lists(
    st.one_of(
        st.tuples(st.just("fail"), st.sampled_from(CODES), st.booleans()),
        st.tuples(st.sampled_from(["lost", "back", "answer", "due"])),
        st.tuples(st.just("refused"), st.booleans()),
        st.tuples(st.just("wait"), st.sampled_from([0.5, 3.0, 12.0, 40.0])),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(held=st.booleans(), life=FINISH_LIFE)
def test_a_held_finish_goes_once_the_node_is_back_and_never_past_its_give_up_time(
    held: bool, life: list[tuple[Any, ...]]
) -> None:
    """Whatever happens to a Finish with recovery (its calls fail, the stream is lost, the node
    is taken back or refused), it is held only while the node registers again, within its
    reconnect window, sent from a hold only once the node is back (with its give-up time
    afresh), never sent nor paused for past its give-up time, and a node whose Finish was
    heard reports no failure."""
    core, clock, give_up = held_finish_core() if held else finishing_core(recovery=True)
    asked: type[Any] | None = steps.HoldFinish if held else steps.SendFinish  # what it waits on
    for what, *args in life:
        event: steps.Event | None = None
        reconnecting = core.lifecycle is Lifecycle.RECONNECTING
        if what == "wait":
            clock.advance(args[0])
        elif what == "fail" and asked is steps.SendFinish:
            event = steps.FinishFailed(args[0], "x", stream_up=args[1] and not reconnecting)
        elif what == "answer" and asked is steps.SendFinish:
            event = steps.FinishAnswered(heard=True)
        elif what == "due" and asked in (steps.RetryFinish, steps.HoldFinish):
            event = steps.FinishRetryDue()
        elif what == "lost" and core.lifecycle is Lifecycle.READY:
            event = steps.StreamLost("Socket closed")
        elif what == "back" and reconnecting:
            event = accepted()
        elif what == "refused" and reconnecting:
            event = steps.Refused("job job-1 is over", finished=args[0])
        if event is None:
            continue
        was_held = asked is steps.HoldFinish
        actions = core.step(event)
        for action in actions:
            if isinstance(action, steps.SendFinish) and was_held:
                give_up = clock() + core.finish_wait_s
            if isinstance(action, FinishWait):
                assert_within(action, clock(), give_up, core.deadline)
                asked = type(action)
            if isinstance(action, steps.HoldFinish):
                assert core.lifecycle is Lifecycle.RECONNECTING
            if isinstance(action, steps.SendFinish) and was_held:
                assert core.lifecycle is not Lifecycle.RECONNECTING, "sent once back"
            if isinstance(action, steps.Fail):
                assert not core.finish_heard, "a node whose Finish was heard reports no failure"
        if (
            core.finish_heard
            or core.over
            or (
                isinstance(event, steps.FinishFailed | steps.FinishRetryDue | steps.FinishAnswered)
                and not any(isinstance(a, FinishWait) for a in actions)
            )
        ):
            asked = None  # heard, given up, or over


def reconnecting_finish_core() -> tuple[WorkerCore, FakeClock]:
    """Without recovery, a formed job's node that lost its stream and finalized: its Finish
    fails at once (nothing listens), held while it registers again."""
    core, clock = ready_core()
    core.step(steps.StreamLost("Socket closed"))
    window_end = core.deadline
    assert window_end == clock() + NODE_S
    core.step(steps.FinishSent())
    said, hold = core.step(steps.FinishFailed("UNAVAILABLE", "connection refused"))
    assert hold == steps.HoldFinish(pytest.approx(window_end - clock()))
    assert isinstance(said, steps.Say)
    assert "this node's finish waits to reach it, up to 30 s more (MS_NODE_TIMEOUT" in said.text
    assert "exits as finished only once its finish is heard" in said.text
    assert not core.over
    assert core.finish_bound_s == 2 * core.finish_wait_s + NODE_S
    return core, clock


def test_a_finish_a_new_scheduler_does_not_know_is_held_for_the_registrations_word() -> None:
    """Without recovery, a node that lost its stream and finalized, whose Finish reached a
    scheduler started since (a new job, which knows no such node: NOT_FOUND): held while the
    node registers again, whose refusal (another job's scheduler) fails it; never "finished"
    on that answer. With its stream up, the same answer ends the Finish unheard, as before."""
    core, _ = ready_core()
    core.step(steps.StreamLost("Socket closed"))
    core.step(steps.FinishSent())
    unknown = "node '0' is not a member of this job"
    _, hold = core.step(steps.FinishFailed("NOT_FOUND", unknown))
    assert isinstance(hold, steps.HoldFinish)
    assert not core.over
    assert not core.finish_heard
    refusal = "the scheduler at 127.0.0.1:8118 runs job j-2, and this node belongs to job j-1"
    actions = core.step(steps.Refused(refusal))
    assert steps.Fail in kinds(actions)
    assert core.lifecycle is Lifecycle.FAILED
    assert not core.finish_heard
    core, _ = ready_core()  # its stream up: the scheduler's word, as ever
    core.step(steps.FinishSent())
    actions = core.step(steps.FinishFailed("NOT_FOUND", unknown, stream_up=True))
    assert not any(isinstance(a, steps.HoldFinish) for a in actions)


def test_without_recovery_a_finish_unheard_as_the_stream_is_lost_is_held_for_the_jobs_word() -> (
    None
):
    """A node without recovery whose stream broke is in a job that failed (the scheduler
    fails a job whose node's stream breaks) unless its Finish got there first: its Finish,
    unheard, is held while it registers again, so that it exits as finished only when its
    Finish is heard, and fails with the scheduler's refusal (or at its window's end)
    otherwise, instead of exiting 0 with its Finish untold."""
    core, _ = reconnecting_finish_core()
    refusal = "job j-1 is over (failed: rank 1 (node '1' at h:1) died: ...); start a new scheduler"
    said, fail = core.step(steps.Refused(refusal))
    assert isinstance(said, steps.Say)
    assert said.text == "could not tell the scheduler at 127.0.0.1:8118 that this node finished"
    assert isinstance(fail, steps.Fail)  # its error line says why, once
    assert isinstance(fail.error, RegistrationRefused)
    assert refusal in str(fail.error)
    assert core.lifecycle is Lifecycle.FAILED
    assert not core.finish_heard
    core, _ = reconnecting_finish_core()  # taken back: the Finish goes, and is heard
    assert kinds(core.step(accepted())) == [steps.Say, steps.Watch]
    assert core.step(steps.FinishRetryDue()) == [steps.SendFinish(core.finish_wait_s)]
    assert core.step(steps.FinishAnswered(heard=True)) == []
    assert core.lifecycle is Lifecycle.FINISHED


def test_without_recovery_a_held_finish_whose_scheduler_does_not_come_back_is_unknown() -> None:
    """The scheduler counted the Finish, ended the job and exited before its answer came (a
    partition at the job's end): without recovery nothing says whether it did, or failed the
    job as the stream broke. The node fails at its window's end (exit 1), saying that this is
    what is unknown, not that the scheduler is overloaded or hung."""
    core, clock = reconnecting_finish_core()
    clock.now = core.deadline
    error = failed_unknown(core.step(steps.PauseOver()))  # its registering again gives up
    assert "and it did not come back within MS_NODE_TIMEOUT=30 s" in error
    assert core.lifecycle is Lifecycle.FAILED
    assert not core.finish_heard


def test_with_its_stream_up_a_finish_is_not_held() -> None:
    """With its stream up, the node is not registering again: a pause, then the Finish
    again."""
    core, _, _ = finishing_core(recovery=True)
    actions = core.step(steps.FinishFailed("UNAVAILABLE", "refused", stream_up=True))
    assert actions == [steps.RetryFinish(FINISH_RETRY.first_s)]


def test_a_call_cut_off_is_made_again_after_its_pause_every_time_with_recovery() -> None:
    core, _ = ready_core(recovery=True, draws=MIDDLE)
    for _ in range(3):
        assert core.step(steps.CallCutOff()) == [steps.RetryCall(CALL_RETRY_PAUSE_S)]
    core.step(steps.Shutdown(ok=True, reason="done"))
    # The job is over for this node: the call waits for the stream's word, then fails.
    assert core.step(steps.CallCutOff()) == [steps.AwaitFatal(FATAL_WAIT_S)]
    core.step(steps.Close())
    assert core.step(steps.CallCutOff()) == []  # closed: the call raises its own error


def test_a_direct_node_of_a_large_job_makes_a_cut_off_call_again_at_its_share() -> None:
    """A standby that does not lead answers a call at once: the job's direct nodes together
    make theirs again at most about LISTEN_TRIES_PER_S times a second. Behind a relay, which
    waits for the scheduler for its host: CALL_RETRY_PAUSE_S."""
    workers = 20_000
    direct = WorkerCore(config(recovery=True, workers=workers), FakeClock(), draws=MIDDLE)
    direct.step(steps.Start(direct=True))
    direct.step(steps.ListeningAwaited())
    direct.step(accepted())
    direct.step(steps.TopologyReady(topology()))
    assert direct.step(steps.CallCutOff()) == [steps.RetryCall(workers / LISTEN_TRIES_PER_S)]
    relayed, _ = ready_core(recovery=True, draws=MIDDLE)
    assert relayed.step(steps.CallCutOff()) == [steps.RetryCall(CALL_RETRY_PAUSE_S)]


def test_a_failed_node_does_nothing_more() -> None:
    core, _ = ready_core()
    core.step(steps.Fatal(ClusterError("topology without this node")))
    for event in (accepted(), steps.TopologyReady(topology(2)), steps.StreamLost("x")):
        assert core.step(event) == []
    assert core.lifecycle is Lifecycle.FAILED


def test_collectives_are_numbered_per_generation() -> None:
    core, _ = ready_core()
    assert [core.next_seq(1), core.next_seq(1), core.next_seq(2), core.next_seq(1)] == [1, 2, 1, 3]


def test_a_collective_that_never_reached_the_scheduler_gives_its_number_back() -> None:
    """Refused on its way (gRPC's size limit), the call took part in no round: the node's next
    collective has its number, the one its peers wait in; not once a later number was taken."""
    core, _ = ready_core()
    assert core.next_seq(1) == 1
    core.collective_unsent(1, 1)
    assert core.next_seq(1) == 1
    assert core.next_seq(1) == 2
    core.collective_unsent(1, 1)  # #2 was taken since: #1 stays used
    assert core.next_seq(1) == 3


def test_the_last_collective_answered_is_kept_for_the_next_registration() -> None:
    """What a restarted scheduler is told: the newest (generation, number) answered, answers
    of an older generation or an earlier number (calls from two threads) never moving it back."""
    core, _ = ready_core()
    assert core.answered == (0, 0)
    for generation, seq in [(1, 1), (1, 3), (1, 2), (2, 1), (1, 4)]:
        core.collective_answered(generation, seq)
    assert core.answered == (2, 1)


# -- the invariants, under any order of what can happen ----------------------------------------

FINAL = (Lifecycle.FAILED, Lifecycle.CLOSED)
FINISH_ANSWERS = (
    steps.FinishAnswered | steps.FinishFailed | steps.FinishRetryDue | steps.FinishCounted
)


class WorkerCoreMachine(RuleBasedStateMachine):
    """Drives the core as the agent does: an answer only to what the core asked for (a
    registration, a probe, a pause), stream events only while it reads a stream."""

    @initialize(
        recovery=st.booleans(),
        verified=st.booleans(),
        hosts=st.sampled_from(["127.0.0.1", "127.0.0.1,127.0.0.2,127.0.0.3"]),
        direct=st.booleans(),
        accept=st.sampled_from([None, False, True]),
    )
    def start(
        self, recovery: bool, verified: bool, hosts: str, direct: bool, accept: bool | None
    ) -> None:
        """`accept`: the first attempt is accepted (as a spare: True), so that runs begin in the
        job as often as they reach it."""
        self.clock = FakeClock()
        self.core = WorkerCore(config(recovery=recovery, hosts=hosts), self.clock)
        self.named: set[str] = set()  # the leaders the schedulers named
        self.asked: type[Any] | None = None  # the I/O the core waits on
        self.failures: list[ClusterError] = []
        self.finished = False  # this node's Finish heard, or the job finished
        self.finish_sent = False  # a Finish call is on its way
        self.held = False  # the Finish waits for the node to be accepted again (HoldFinish)
        self.give_up = 0.0  # when the Finish on its way is given up
        self.generation = 0
        self.spare_since: float | None = None  # accepted as a spare then, and not promoted
        self.lost_at = 0.0  # when the node's stream last ended (lost, or "not the leader")
        self.relay_unanswered = False  # the last registration went through a relay, unanswered
        self.take(self.core.step(steps.Start(verified, direct=direct)))
        if accept is not None and self.asked is steps.Register:
            self.step(dataclasses.replace(accepted(), spare=accept))

    def take(self, actions: list[steps.Action]) -> None:
        """Check what the core decided, as the agent would carry it out."""
        now = self.clock()
        # A fatal decision is final: a batch that leaves the core failed or closed holds the
        # Fail or Done that did it (a note may come first), and nothing after it.
        ending = [i for i, a in enumerate(actions) if isinstance(a, steps.Fail | steps.Done)]
        if self.core.lifecycle in FINAL and actions:
            assert ending, actions
        if ending:
            assert all(isinstance(a, steps.Fail | steps.Done) for a in actions[ending[0] :])
        for action in actions:
            if isinstance(action, steps.Fail):
                assert not self.finished, "a finished node reports no failure"
                assert str(action.error).strip()
                assert not str(action.error).rstrip().endswith(":"), "a failure says why"
                self.failures.append(action.error)
                self.asked = None
                self.held = False  # a held Finish ends with the node's failure
            elif isinstance(action, steps.Register | steps.CheckScheduler | steps.AwaitListening):
                # Reconnect deadlines are honoured: no attempt (nor wait for the scheduler's
                # port) starts after its deadline, nor outlasts it.
                assert now < self.core.deadline
                limit = action.attempt_s if isinstance(action, steps.Register) else action.timeout_s
                assert 0 < limit <= self.core.deadline - now + 1e-9
                if isinstance(action, steps.AwaitListening):
                    # A refused wait ends a pace after its last try: within the deadline too.
                    assert 0 < action.every_s <= self.core.deadline - now + 1e-9
                self.asked = type(action)
            elif isinstance(action, steps.Pause):
                assert 0 <= action.seconds <= max(self.core.deadline - now, 0.0) + 1e-9
                self.asked = steps.Pause
            elif isinstance(action, steps.Watch):
                assert self.core.lifecycle in (Lifecycle.FORMING, Lifecycle.READY, Lifecycle.SPARE)
                self.asked = steps.Watch
                if self.core.lifecycle is Lifecycle.SPARE:
                    self.spare_since = now if self.spare_since is None else self.spare_since
                elif self.core.topology is not None:
                    self.spare_since = None
            elif isinstance(action, steps.Released):
                # Let go (exit 0) only when the job ended well without needing this node.
                assert self.core.topology is None
                assert not self.failures
                self.finished = True
            elif isinstance(action, steps.Deliver):
                assert not self.failures, "never both failed and ready"
                assert self.core.topology is action.topology
            elif isinstance(action, steps.Done):
                self.asked = None
            elif isinstance(action, FinishWait):
                assert_within(action, now, self.give_up, self.core.deadline)
                if isinstance(action, steps.HoldFinish):
                    # Held only while registering again: with recovery, with a scheduler that
                    # may come back; without, to learn whether the job failed.
                    assert self.core.lifecycle is Lifecycle.RECONNECTING
                self.held = isinstance(action, steps.HoldFinish)
                self.finish_sent = isinstance(action, steps.SendFinish | steps.RetryFinish)
            elif isinstance(action, steps.Follow):
                # Only an address of the configuration, or one a scheduler named, is followed.
                assert action.address in self.core.config.addresses or action.address in self.named
                assert self.core.address == action.address

    def a_spare_fails_only_for_a_deadline_set_since_it_was_accepted(
        self, error: ClusterError
    ) -> None:
        """A spare has no deadline of its own: the one it may fail for is set when its stream
        ends (lost, or the leader handing over), never the start's MS_TOPO_TIMEOUT or another
        set before it was accepted; so it fails no sooner than MS_NODE_TIMEOUT after that."""
        if self.spare_since is None or self.core.topology is not None:
            return
        if isinstance(error, SchedulerUnreachableError):
            assert self.lost_at >= self.spare_since, error
            assert self.clock() >= self.lost_at + NODE_S - 1e-9, error

    def step(self, event: steps.Event) -> list[steps.Action]:
        before = self.core.lifecycle
        actions = self.core.step(event)
        self.take(actions)
        if not isinstance(event, FINISH_ANSWERS):  # (one may report a failure held for it)
            for error in fails(actions):
                self.a_spare_fails_only_for_a_deadline_set_since_it_was_accepted(error)
        if before in FINAL:
            assert self.core.lifecycle is before, "a fatal decision is final"
        if self.core.finish_heard or self.core.lifecycle in FINAL:
            self.finished |= self.core.finish_heard  # (a job that finished heard it too)
            self.held = False  # the Finish's answer is had: nothing more to send
        return actions

    # -- answers to what the core asked ---------------------------------------------------------

    @precondition(lambda self: self.asked is steps.Register)
    @rule(rejoined=st.booleans(), spare=st.booleans())
    def accepted(self, rejoined: bool, spare: bool) -> None:
        answer = accepted(max(self.generation, 1), rejoined)
        self.step(dataclasses.replace(answer, spare=spare and not rejoined))

    @precondition(lambda self: self.asked is steps.Register)
    @rule(
        transient=st.booleans(),
        retry=st.sampled_from([0.0, 1.0, 29.0]),
        ended=st.booleans(),
        foreign=st.booleans(),
    )
    def refused(self, transient: bool, retry: float, ended: bool, foreign: bool) -> None:
        """`foreign`: as a node of another job (a scheduler given another prefix, or a stale
        record), which a node of a job that knows other schedulers passes over."""
        finished = ended and not transient
        foreign = foreign and not (transient or finished)
        self.step(
            steps.Refused(
                "refused", transient, retry_after_s=retry, finished=finished, foreign=foreign
            )
        )

    @precondition(lambda self: self.asked is steps.Register)
    @rule(seconds=st.sampled_from([0.1, 3.0]), relayed=st.booleans())
    def unanswered(self, seconds: float, relayed: bool) -> None:
        """`relayed`: through the host's relay, which neither answered nor cut it off."""
        self.clock.now += seconds
        self.step(steps.Unanswered(relay="unix:/r.sock" if relayed else ""))
        self.relay_unanswered = relayed

    @precondition(lambda self: self.asked in (steps.Register, steps.Watch))
    @rule(leader=st.sampled_from(["", "10.0.0.2:8118", "127.0.0.1:8118", "127.0.0.2:8118"]))
    def not_leader(self, leader: str) -> None:
        self.named.add(leader)
        if self.asked is steps.Watch:  # the stream ends with it: the leader hands over
            self.lost_at = self.clock()
        self.step(steps.NotLeader(leader, retry_after_s=0.5))

    @precondition(lambda self: self.asked is steps.AwaitListening)
    @rule(refused=st.booleans(), waited=st.sampled_from([0.0, 3.0]))
    def listening_awaited(self, refused: bool, waited: float) -> None:
        self.clock.now += waited
        self.step(steps.ListeningAwaited(refused, "connection refused" if refused else ""))

    @precondition(lambda self: self.asked is steps.CheckScheduler)
    @rule(ok=st.booleans())
    def checked(self, ok: bool) -> None:
        """The relay is left only when it answered the registration before with nothing and the
        scheduler answers the probe."""
        decided = self.step(steps.Checked(ok, "" if ok else "connection refused"))
        left = [a for a in decided if isinstance(a, steps.LeaveRelay)]
        assert len(left) == (ok and self.relay_unanswered), decided
        self.relay_unanswered = False

    @precondition(lambda self: self.asked is steps.Pause)
    @rule(overslept=st.sampled_from([0.0, 5.0]))
    def pause_over(self, overslept: float) -> None:
        self.clock.now += overslept
        self.step(steps.PauseOver())

    # -- the stream -----------------------------------------------------------------------------

    @precondition(lambda self: self.asked is steps.Watch)
    @rule(registered=st.integers(0, 2))
    def progress(self, registered: int) -> None:
        self.step(steps.Progress(registered, 2))

    @precondition(lambda self: self.asked is steps.Watch)
    @rule(newer=st.booleans())
    def topology_ready(self, newer: bool) -> None:
        self.generation = max(self.generation, 1) + int(newer)
        self.step(steps.TopologyReady(topology(self.generation)))

    @precondition(lambda self: self.asked is steps.Watch)
    @rule(node_id=st.sampled_from(["0", "1"]), older=st.booleans())
    def node_failed(self, node_id: str, older: bool) -> None:
        self.step(steps.NodeFailed(int(node_id), node_id, "killed", self.generation - older))

    @precondition(lambda self: self.asked is steps.Watch)
    @rule(ok=st.booleans())
    def shutdown(self, ok: bool) -> None:
        self.step(steps.Shutdown(ok, "done" if ok else "rank 1 failed"))
        if ok and self.core.lifecycle is Lifecycle.FINISHED:
            self.finished = True

    @precondition(lambda self: self.asked is steps.Watch)
    @rule(silent=st.booleans(), relayed=st.booleans())
    def stream_lost(self, silent: bool, relayed: bool) -> None:
        """`relayed`: silent through a relay that answers (the agent marks it)."""
        self.lost_at = self.clock()
        relay = "unix:/r.sock" if silent and relayed else ""
        self.step(steps.StreamLost("connection reset", NODE_S if silent else None, relay=relay))

    @precondition(lambda self: self.asked is steps.Watch)
    @rule(spare=st.booleans())
    def a_topology_without_this_node(self, spare: bool) -> None:
        if spare:
            self.step(steps.Unplaced(self.generation + 1))
        else:
            self.step(steps.Fatal(ClusterError("a topology without this node")))

    # -- the user's side and time --------------------------------------------------------------

    @precondition(lambda self: self.core.may_finish and not (self.finish_sent or self.held))
    @rule()
    def finish_sent(self) -> None:
        self.give_up = self.clock() + self.core.finish_wait_s
        actions = self.core.step(steps.FinishSent())
        assert actions == [steps.SendFinish(self.core.finish_wait_s)]
        self.finish_sent = True

    @precondition(lambda self: self.finish_sent)
    @rule(
        code=st.sampled_from(["UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED"]),
        stream_up=st.booleans(),
        took_s=st.sampled_from([0.0, 3.0, 30.0]),
    )
    def finish_failed(self, code: str, stream_up: bool, took_s: float) -> None:
        self.clock.now += took_s
        reconnecting = self.core.lifecycle is Lifecycle.RECONNECTING
        self.finish_sent = False
        actions = self.step(steps.FinishFailed(code, "x", stream_up=stream_up))
        retries = [a for a in actions if isinstance(a, steps.RetryFinish)]
        if self.held:
            # Held: it never reached a scheduler (or timed out as the stream was lost too),
            # which may be back (recovery), within the node's reconnect window.
            assert code in FINISH_RETRIED or code == "DEADLINE_EXCEEDED"
            assert reconnecting
            assert self.clock() < self.core.deadline
        if not retries:
            return
        assert actions == retries
        assert code in FINISH_RETRIED
        assert stream_up
        assert self.clock() + retries[0].after_s < self.give_up
        self.clock.now += retries[0].after_s
        (send,) = self.step(steps.FinishRetryDue())
        assert send == steps.SendFinish(self.give_up - self.clock())

    @precondition(lambda self: self.held)
    @rule(waited_s=st.sampled_from([0.0, 2.0, 40.0]))
    def hold_over(self, waited_s: float) -> None:
        """The node was accepted again, the job ended for it, or the hold's time ran out (the
        agent wakes for either): the Finish goes (with its give-up time afresh), is held on,
        or ends."""
        reconnecting = self.core.lifecycle is Lifecycle.RECONNECTING
        until = self.core.deadline if reconnecting else float("inf")
        self.clock.now = max(self.clock(), min(self.clock() + waited_s, until))
        self.held = False
        if not reconnecting:
            self.give_up = self.clock() + self.core.finish_wait_s
        actions = self.step(steps.FinishRetryDue())
        if any(isinstance(a, steps.SendFinish) for a in actions):
            assert not reconnecting, "a held Finish goes once the node is back"
        if not actions:
            assert self.core.finish_heard or self.core.over

    @precondition(lambda self: self.held)
    @rule()
    def finish_counted(self) -> None:
        """The agent's look at the scheduler's saved state, while the Finish is held, found it
        counted: the node is done, and reports no failure from then on."""
        self.held = False
        actions = self.step(steps.FinishCounted("its saved state lists this node as finished"))
        assert kinds(actions) == [steps.Say, steps.Done]
        assert self.core.finish_heard

    @precondition(lambda self: self.finish_sent)
    @rule(heard=st.booleans())
    def finish_answered(self, heard: bool) -> None:
        self.finish_sent = self.held = False
        self.step(steps.FinishAnswered(heard, details="" if heard else "UNAVAILABLE"))

    @rule(now=st.integers(0, 3))
    def call_cut_off(self, now: int) -> None:
        if now:  # now and then: the core's answer never changes its state
            return
        decided = self.core.step(steps.CallCutOff())
        assert all(isinstance(a, steps.RetryCall | steps.AwaitFatal) for a in decided)

    @precondition(lambda self: self.core.lifecycle is Lifecycle.SPARE)
    @rule()
    def a_spare_waits_past_MS_TOPO_TIMEOUT(self) -> None:
        """As spares do, while the job they wait to serve runs."""
        self.clock.now += TOPO_S + 10.0
        self.step(steps.DeadlinePassed())

    @rule(seconds=st.sampled_from([1.0, 10.0, 31.0, 70.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds
        self.step(steps.DeadlinePassed())

    @rule(now=st.integers(0, 9))
    def close(self, now: int) -> None:
        if now:  # closed now and then, not at every other step (a run ends there)
            return
        self.step(steps.Close())
        self.asked = None

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def a_failure_is_reported_once_and_only_when_failed(self) -> None:
        assert len(self.failures) <= 1
        if self.core.lifecycle is Lifecycle.FAILED:
            assert self.failures == [self.core.error]
        elif self.core.lifecycle is not Lifecycle.CLOSED:
            assert self.failures == []

    @invariant()
    def ready_means_a_topology(self) -> None:
        if self.core.lifecycle is Lifecycle.READY:
            assert self.core.topology is not None
        if self.core.lifecycle is Lifecycle.FORMING:
            assert self.core.topology is None

    @invariant()
    def a_registration_past_its_deadline_is_failed_at_its_next_step(self) -> None:
        registering = self.core.lifecycle in (Lifecycle.JOINING, Lifecycle.RECONNECTING)
        due = self.asked is steps.Pause and self.clock() >= self.core.deadline
        if registering and due and not self.finish_sent:
            actions = self.core.step(steps.PauseOver())
            # (A Finish held for the node's return is given up with it, and says so.)
            assert kinds(actions) == [steps.Say, steps.Fail] if self.held else [steps.Fail]
            self.take(actions)


WorkerCoreMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_worker_core_machine = WorkerCoreMachine.TestCase


def test_a_job_that_finished_before_this_node_had_its_topology_is_not_its_finish() -> None:
    core = WorkerCore(config(), FakeClock())
    core.step(steps.Start())
    core.step(accepted())
    actions = core.step(steps.Shutdown(ok=True, reason="every node finished"))
    assert kinds(actions) == [steps.Fail, steps.Done]
    assert core.lifecycle is Lifecycle.FAILED
