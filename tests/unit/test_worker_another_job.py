"""A scheduler that runs another job, without a network (the worker core, an injected clock).

A standby started with a mistyped CLUSTER_STATE_URL prefix finds nothing saved there and leads a
job of its own. When the real leader dies, the workers that know every scheduler come to it, and
it refuses them as nodes of another job (REFUSAL_FOREIGN_JOB). They exited at that refusal,
though the other schedulers they knew (the real standby) would have taken them back, and the
job was lost. A node of a job that knows several schedulers now passes such a one over, says so
once, and gives up only at its deadline, naming the refusal.

Behind a host's relay the refusal is the relay's scheduler's, whichever address the node asked:
the relay, on the other job's scheduler, refused the node at every address it asked, and the job
was lost. The node now leaves the relay and asks directly, where the rule above applies."""

from __future__ import annotations

from collections.abc import Callable

import hypothesis.strategies as st
import pytest
from hypothesis import given

from cluster.protocol.errors import RegistrationRefused, SchedulerUnreachableError
from cluster.worker.machine import steps
from cluster.worker.machine.core import Lifecycle, WorkerCore
from tests.conftest import FakeClock
from tests.unit.test_worker_core import (
    NODE_S,
    TOPO_S,
    accepted,
    config,
    fails,
    kinds,
    ready_core,
    topology,
)

LEADER, WRONG, STANDBY = "127.0.0.1:8118", "127.0.0.2:8118", "127.0.0.3:8118"
HOSTS = "127.0.0.1,127.0.0.2,127.0.0.3"
FOREIGN = (
    "node '0' belongs to job job-1, but this scheduler runs job job-9, which it started anew "
    "under etcd://e1:2379/jobs/typo, where nothing was saved: ... the wrong CLUSTER_STATE_URL"
)


RELAY = "unix:/run/relay.sock"


def another_job(relay: str = "") -> steps.Refused:
    return steps.Refused(FOREIGN, foreign=True, relay=relay)


def said(actions: list[steps.Action]) -> list[str]:
    return [action.text for action in actions if isinstance(action, steps.Say)]


def lose_the_leader(core: WorkerCore) -> None:
    """The leader dies: the stream breaks, the probe finds it down, the next is asked."""
    assert kinds(core.step(steps.StreamLost("connection reset")))[-1] is steps.CheckScheduler
    assert core.step(steps.Checked(False, "connection refused"))[0] == steps.Follow(WRONG)
    assert core.step(steps.PauseOver()) == [steps.CheckScheduler(1.0)]
    assert kinds(core.step(steps.Checked(True))) == [steps.Register]


def registering_with_the_standby() -> WorkerCore:
    """A restarted node of job-1 (its record's id) that knows WRONG and STANDBY: WRONG refused
    it as another job's, and it registers with STANDBY now."""
    core = WorkerCore(config(hosts="127.0.0.2,127.0.0.3"), FakeClock(), cluster_id="job-1")
    core.step(steps.Start())
    core.step(another_job())
    assert core.step(steps.PauseOver()) == [steps.CheckScheduler(1.0)]
    assert kinds(core.step(steps.Checked(True))) == [steps.Register]
    return core


def test_a_scheduler_of_another_job_is_passed_over_for_the_jobs_standby() -> None:
    core, clock = ready_core(recovery=True, hosts=HOSTS)
    lose_the_leader(core)
    actions = core.step(another_job())
    (line,) = said(actions)
    assert line.startswith(f"the scheduler at {WRONG} runs another job, and refused this node: ")
    assert FOREIGN in line
    assert f"tries its job's other schedulers, for up to {TOPO_S:.0f} s more" in line
    assert kinds(actions) == [steps.Say, steps.Follow, steps.Pause]
    assert actions[1] == steps.Follow(STANDBY)
    assert fails(actions) == []
    # The standby takes the job over, and takes the node back.
    clock.advance(0.1)
    assert kinds(core.step(steps.PauseOver())) == [steps.CheckScheduler]
    assert kinds(core.step(steps.Checked(True))) == [steps.Register]
    assert kinds(core.step(accepted())) == [steps.Say, steps.Watch]
    assert (core.address, core.lifecycle) == (STANDBY, Lifecycle.READY)


def answer(core: WorkerCore, clock: FakeClock, action: steps.Action) -> list[steps.Action]:
    """What the schedulers answer: the leader is down, the standby names no leader (an election
    that never ends), the wrong one refuses the node as another job's."""
    match action:
        case steps.CheckScheduler():
            return core.step(steps.Checked(core.address != LEADER, "connection refused"))
        case steps.Register() if core.address == WRONG:
            return core.step(another_job())
        case steps.Register():
            return core.step(steps.NotLeader("", retry_after_s=0.5))
        case steps.Pause(seconds=seconds):
            clock.advance(seconds)
            return core.step(steps.PauseOver())
        case _:
            return []


@given(recovery=st.booleans())
def test_a_node_refused_by_another_jobs_scheduler_gives_up_only_at_its_deadline(
    recovery: bool,
) -> None:
    core, clock = ready_core(recovery=recovery, hosts=HOSTS)
    lose_the_leader(core)
    deadline = core.deadline
    assert deadline - clock() == (max(NODE_S, TOPO_S) if recovery else NODE_S)
    pending, lines = core.step(another_job()), []
    for _ in range(100_000):
        lines += said(pending)
        if fails(pending):
            break
        pending = [a for action in pending for a in answer(core, clock, action)]
    (error,) = fails(pending)
    assert clock() >= deadline
    assert isinstance(error, SchedulerUnreachableError)
    assert str(error).endswith(
        f"; the scheduler at {WRONG} runs another job, and refused this node: {FOREIGN}"
    )
    assert len([line for line in lines if "runs another job" in line]) == 1, lines


Respond = Callable[[WorkerCore, FakeClock, steps.Action], list[steps.Action]]
# The order of the addresses, and what the standby answers before it leads (down a moment, an
# election under way, the dead leader still named).
ORDERS = st.permutations([LEADER, WRONG, STANDBY])
STANDBY_ANSWERS = st.lists(st.sampled_from(["down", "no leader", "the dead leader"]), max_size=8)


def back_after_losing_the_leader(
    order: list[str], respond: Respond, *, relay: str = ""
) -> list[str]:
    """A node of schedulers `order` (`relay`: behind that relay), in the job on its leader,
    loses the leader's stream; the schedulers answer as `respond` says until the node is back
    or fails (asserted not). What it said meanwhile."""
    clock = FakeClock()
    core = WorkerCore(config(recovery=True, hosts=",".join(a.split(":")[0] for a in order)), clock)
    core.step(steps.Start(direct=not relay))
    if core.address != LEADER:  # the node joined the job on its leader, as named to it
        core.step(steps.NotLeader(LEADER))
    assert core.address == LEADER
    core.step(accepted())
    core.step(steps.TopologyReady(topology()))
    pending, lines = core.step(steps.StreamLost("connection reset")), []
    for _ in range(10_000):
        lines += said(pending)
        if fails(pending) or core.lifecycle is Lifecycle.READY:
            break
        pending = [a for action in pending for a in respond(core, clock, action)]
    assert fails(pending) == []
    assert (core.lifecycle, core.address) == (Lifecycle.READY, STANDBY)
    return lines


@given(order=ORDERS, standby=STANDBY_ANSWERS)
def test_the_job_survives_another_jobs_scheduler_whatever_the_order(
    order: list[str], standby: list[str]
) -> None:
    """Whatever the order of the addresses, and whatever the standby answers before it leads
    (down a moment, an election under way, the dead leader still named), the node passes the
    other job's scheduler over, says so once, and is taken back by the standby."""
    lines = back_after_losing_the_leader(
        order, lambda core, clock, action: respond(core, clock, action, standby)
    )
    assert len([line for line in lines if "runs another job" in line]) <= 1, lines


def respond(
    core: WorkerCore, clock: FakeClock, action: steps.Action, standby: list[str]
) -> list[steps.Action]:
    """The dead leader is down; the other job's scheduler refuses the node; the standby answers
    `standby` in turn, then takes the node back."""
    event: steps.Event
    match action:
        case steps.CheckScheduler() if core.address == STANDBY and standby[:1] == ["down"]:
            standby.pop(0)
            event = steps.Checked(False, "connection refused")
        case steps.CheckScheduler():
            event = steps.Checked(core.address != LEADER, "connection refused")
        case steps.Register() if core.address == WRONG:
            event = another_job()
        case steps.Register() if core.address == STANDBY and standby and standby[0] != "down":
            named = LEADER if standby.pop(0) == "the dead leader" else ""
            event = steps.NotLeader(named, retry_after_s=0.5)
        case steps.Register():
            assert core.address == STANDBY
            event = accepted()
        case steps.Pause(seconds=seconds):
            clock.advance(seconds)
            event = steps.PauseOver()
        case _:
            return []
    return core.step(event)


@pytest.mark.parametrize("relay", ["", RELAY], ids=["direct", "behind a relay"])
@pytest.mark.parametrize(
    ("hosts", "member"),
    [("127.0.0.2", True), (HOSTS, False)],
    ids=["one scheduler", "no job yet"],
)
def test_the_refusal_fails_a_node_at_once_that_has_no_other_scheduler_or_no_job(
    hosts: str, member: bool, relay: str
) -> None:
    """With one scheduler, there is no other to try (a relay follows no other either); a node
    that belongs to no job yet is refused as another job's by no scheduler of its own job."""
    core = WorkerCore(config(hosts=hosts), FakeClock(), cluster_id="job-1" if member else "")
    core.step(steps.Start())
    (error,) = fails(core.step(another_job(relay)))
    assert isinstance(error, RegistrationRefused)
    assert str(error).endswith(f"refused this node: {FOREIGN}")


def test_a_restarted_node_with_its_jobs_id_passes_over_another_jobs_scheduler() -> None:
    """A worker process restarted (its cluster id from its record) whose first scheduler runs
    another job tries the next one."""
    core = WorkerCore(config(hosts="127.0.0.2,127.0.0.3"), FakeClock(), cluster_id="job-1")
    core.step(steps.Start())
    actions = core.step(another_job())
    assert kinds(actions) == [steps.Say, steps.Follow, steps.Pause]
    assert actions[1] == steps.Follow(STANDBY)


def test_a_node_every_scheduler_refuses_as_another_jobs_fails_at_once() -> None:
    """A worker whose record names a job that none of its schedulers runs (the job was moved
    away, a new one started) is refused so by each in turn: it fails once every one has,
    naming each refusal, rather than asking them again until its deadline."""
    core = registering_with_the_standby()
    (error,) = fails(core.step(another_job()))
    assert isinstance(error, RegistrationRefused)
    message = str(error)
    assert message.startswith("every scheduler this node knows runs another job")
    assert f"{WRONG}: {FOREIGN}" in message
    assert f"{STANDBY}: {FOREIGN}" in message


def test_behind_a_relay_the_refusal_leaves_the_relay_and_asks_the_same_scheduler_directly() -> None:
    """The relay forwards to the scheduler it follows, whichever address the node asked: its
    refusal names none of them. The node leaves the relay (for its scheduler's refusal, not as
    lost), asks the same address directly at once, and passes over there only a scheduler that
    refused it itself."""
    core, clock = ready_core(recovery=True, hosts=HOSTS)
    lose_the_leader(core)  # registering with the next in turn, through the relay
    left, register = core.step(another_job(RELAY))
    assert left == steps.LeaveRelay(
        f"the scheduler it forwards to runs another job: {FOREIGN}", refused=True
    )
    assert isinstance(register, steps.Register)
    assert core.address == WRONG  # asked again, directly: nothing passed over yet
    # Directly: that one refuses it itself, and is passed over, said once.
    actions = core.step(another_job())
    assert kinds(actions) == [steps.Say, steps.Follow, steps.Pause]
    assert actions[1] == steps.Follow(STANDBY)
    clock.advance(1.0)
    core.step(steps.PauseOver())
    assert kinds(core.step(steps.Checked(True))) == [steps.Register]
    assert kinds(core.step(accepted())) == [steps.Say, steps.Watch]
    assert (core.address, core.lifecycle) == (STANDBY, Lifecycle.READY)


@given(order=ORDERS, standby=STANDBY_ANSWERS)
def test_behind_a_relay_on_another_jobs_scheduler_the_job_survives_whatever_the_order(
    order: list[str], standby: list[str]
) -> None:
    """The relay sits on the other job's scheduler (it answers as a leader, and the relay moves
    on no refusal): every registration through it is refused so, whatever address the node
    asked. The node leaves the relay once, asks directly from then on, passes the other job's
    scheduler over, says so at most once, and is taken back by the standby."""
    shell = {"relay": True, "left": 0}
    lines = back_after_losing_the_leader(
        order, lambda core, clock, action: behind(core, clock, action, standby, shell), relay=RELAY
    )
    assert shell["left"] == 1
    assert len([line for line in lines if "runs another job" in line]) <= 1, lines


def behind(
    core: WorkerCore,
    clock: FakeClock,
    action: steps.Action,
    standby: list[str],
    shell: dict[str, int],
) -> list[steps.Action]:
    """`respond`, with a relay on the other job's scheduler while the node talks through it."""
    if isinstance(action, steps.LeaveRelay):
        assert action.refused
        shell["relay"], shell["left"] = False, shell["left"] + 1
        return []
    if isinstance(action, steps.Register) and shell["relay"]:
        return core.step(another_job(RELAY))
    return respond(core, clock, action, standby)


def test_a_standby_naming_as_its_leader_one_that_refused_the_node_so_is_followed_once() -> None:
    """The leader refused the node as another job's (its record names an older job), and the
    next scheduler, a standby, names that leader. It is asked again (it may have been started
    again with the job's prefix since, and won the lease): refused again, the node fails at
    once, naming both, rather than following it to be refused until its deadline."""
    core = registering_with_the_standby()
    followed = core.step(steps.NotLeader(WRONG))
    assert fails(followed) == []
    assert steps.Follow(WRONG) in followed
    assert kinds(followed)[-1] is steps.Register
    (error,) = fails(core.step(another_job()))
    assert isinstance(error, RegistrationRefused)
    assert str(error) == (
        f"the scheduler at {STANDBY} is a standby of the scheduler at {WRONG}, which runs another "
        f"job, and refused this node again: {FOREIGN}; no scheduler of theirs runs this node's job"
    )


def test_a_scheduler_started_again_with_the_jobs_prefix_takes_the_node_back() -> None:
    """The scheduler that refused the node as another job's was started again with the job's
    prefix and leads: the standby names it, and it takes the node."""
    core = registering_with_the_standby()
    core.step(steps.NotLeader(WRONG))
    assert kinds(core.step(accepted())) == [steps.Watch]
    assert (core.address, core.lifecycle) == (WRONG, Lifecycle.FORMING)
    assert fails(core.step(steps.TopologyReady(topology()))) == []
