"""The parts of the scheduler's state machine on their own: liveness, ranks, the rollback
planner (admission and the spare pool have their own files: test_admission, test_spares)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.records import Member, NodeRole, NodeState
from cluster.protocol.settings import JobSettings
from cluster.scheduler.machine.liveness import Liveness
from cluster.scheduler.machine.ranks import assign_ranks, missing_ranks, ranges
from cluster.scheduler.machine.rollback import (
    HELD_BY_ALL_EVERY_S,
    NoCommonStep,
    RollbackPlanner,
    from_the_beginning,
    rollback_step,
)

SETTINGS = JobSettings(
    worker_num=4, server_num=0, node_timeout_s=10.0, topo_timeout_s=60.0, heartbeat_interval_s=1.0
)


def member(node_id: str, host: str = "h0", *, checkpoints: tuple[int, ...] = ()) -> Member:
    return Member(
        node_id=node_id,
        role=NodeRole.WORKER,
        host=host,
        port=5000,
        incarnation=1,
        last_seen=0.0,
        checkpoints=checkpoints,
    )


def test_silence_counts_from_the_last_accepted_registration() -> None:
    live = Liveness(SETTINGS)
    m = member("0")
    live.seen(m, 100.0)
    assert live.silence(m, 105.0) == 5.0
    live.accepted(103.0)  # a burst of registrations: its beats wait behind them
    assert live.silence(m, 105.0) == 2.0
    assert live.due(m) == 103.0 + SETTINGS.silence_limit_s


def test_a_scan_is_due_only_when_a_silence_may_have_reached_its_limit() -> None:
    live = Liveness(SETTINGS)
    assert live.scan_due(0.0)  # never scanned
    m = member("0")
    live.seen(m, 10.0)
    limit = 10.0 + SETTINGS.silence_limit_s
    assert live.next_scan == limit
    assert not live.scan_due(limit - 0.1)
    assert live.scan_due(limit)
    live.found(live.due(m))
    assert live.next_scan == limit


def test_a_failed_member_is_due_when_its_guard_and_rejoin_window_end() -> None:
    live = Liveness(SETTINGS)
    m = member("0")
    m.state, m.last_seen = NodeState.FAILED, 50.0
    assert live.due(m) == 50.0 + 10.0 + 60.0
    m.state = NodeState.FINISHED
    assert live.due(m) == float("inf")


def test_the_scheduler_discounts_its_own_stall() -> None:
    live = Liveness(SETTINGS)
    a, b = member("0"), member("1")
    live.seen(a, 100.0)
    live.seen(b, 108.0)
    live.discount_stall([a, b], 8.0, now=110.0)
    assert (a.last_seen, b.last_seen) == (108.0, 110.0)  # never past now
    assert live.scan_due(110.0)


@given(hosts=st.lists(st.sampled_from(["h0", "h1", "h2"]), min_size=1, max_size=8))
def test_ranks_are_a_permutation_and_local_ranks_follow_the_hosts(hosts: list[str]) -> None:
    members = [member(f"w{i}", host) for i, host in enumerate(hosts)]
    assign_ranks(members, len(members))
    assert sorted(m.rank for m in members if m.rank is not None) == list(range(len(members)))
    for host in set(hosts):
        here = sorted((m for m in members if m.host == host), key=lambda m: m.rank or 0)
        assert [m.local_rank for m in here] == list(range(len(here)))
        assert {m.local_size for m in here} == {len(here)}


def test_numeric_node_ids_are_their_ranks_and_the_missing_are_named() -> None:
    members = [member("3"), member("0")]
    assign_ranks(members, 4)
    assert [m.rank for m in members] == [3, 0]
    spans = missing_ranks(members, 4)
    assert spans == [(1, 2)]
    assert ranges([(1, 2), (5, 5)]) == "1-2, 5"
    assert missing_ranks([member("a")], 4) is None


def test_the_rollback_step_is_the_newest_step_every_worker_holds() -> None:
    assert rollback_step([member("0"), member("1")]) == 0
    both = [member("0", checkpoints=(10, 20, 30)), member("1", checkpoints=(20, 30, 40))]
    assert rollback_step(both) == 30
    apart = rollback_step([member("0", checkpoints=(10,)), member("1", checkpoints=(20,))])
    assert isinstance(apart, NoCommonStep)
    assert "keep more checkpoints" in apart.message
    assert from_the_beginning(both) == from_the_beginning([member("0"), member("1")]) == ""


def test_a_worker_without_a_checkpoint_makes_the_rollback_step_the_beginning() -> None:
    """Rank 0 killed after rank 1 saved step 5 but before rank 0 saved any: on disk, rank 0 can
    only start from the beginning, so the rollback step is 0, and the generation's reason says
    why. The survivors may hold a newer step in memory, which the workers decide on after the
    generation is out: the reason says what they do either way, not that all start at 0."""
    early = [member("0"), member("1", checkpoints=(5,))]
    assert rollback_step(early) == 0
    assert from_the_beginning(early) == (
        "no checkpoint on disk yet at node '0' at h0:5000, so the rollback step is 0: the "
        "workers resume from the step the survivors hold in memory if they can, else from the "
        "beginning"
    )


steps = st.frozensets(st.integers(min_value=1, max_value=12), max_size=4)


@given(st.lists(steps, min_size=1, max_size=5))
def test_the_rollback_step_is_the_newest_step_every_worker_can_start_from(
    held: list[frozenset[int]],
) -> None:
    """Every worker can start from the beginning (0) or from a step it holds; the rollback
    step is the newest such step common to all, and the job fails only when every worker
    holds checkpoints and none is common (going back to 0 would discard them all)."""
    workers = [member(str(i), checkpoints=tuple(sorted(h))) for i, h in enumerate(held)]
    step = rollback_step(workers)
    startable = set.intersection(*({0} | h for h in held))
    if all(held) and startable == {0}:
        assert isinstance(step, NoCommonStep)
        for i, h in enumerate(held):
            assert f"node '{i}'" in step.message
    else:
        assert step == max(startable)
    assert bool(from_the_beginning(workers)) == (any(held) and not all(held))


def test_held_by_all_is_computed_at_most_once_a_second_per_generation() -> None:
    planner = RollbackPlanner()
    workers = [member("0", checkpoints=(10,)), member("1", checkpoints=(10,))]
    for generation in (1, 2):
        for w in workers:
            assert planner.report(w.node_id, 1, (generation, generation), generation)
        if generation == 1:
            assert planner.held_by_all(1, workers, 0.0, published_step=0) == 10
            workers[0].checkpoints = workers[1].checkpoints = (10, 20)
            assert planner.held_by_all(1, workers, HELD_BY_ALL_EVERY_S / 2, 0) == 10  # a moment ago
            assert planner.held_by_all(1, workers, HELD_BY_ALL_EVERY_S, 0) == 20
            workers[0].checkpoints = ()
    assert planner.held_by_all(2, workers, HELD_BY_ALL_EVERY_S, 0) == 0  # a new generation


def test_held_by_all_waits_at_the_rollback_step_for_workers_not_yet_in_the_generation() -> None:
    planner = RollbackPlanner()
    workers = [member("0", checkpoints=(10, 20)), member("1", checkpoints=(10, 20))]
    assert planner.report("0", 1, (2, 1), 2)
    assert planner.held_by_all(2, workers, 0.0, published_step=10) == 10  # "1" has not said
    assert planner.report("1", 1, (2, 1), 2)
    assert planner.held_by_all(2, workers, 0.0, published_step=10) == 20
    assert not planner.report("1", 1, (1, 1), 2)  # the same number again: not taken
