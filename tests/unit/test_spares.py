"""Hot spares in the scheduler's state machine (issue #15): the rules by name, and a hypothesis
machine of their invariants (a rank has at most one live holder, a guarded id never holds a
rank during its guard, the number of ranks never changes, a refused call changes nothing, a
rank given to a spare once every other worker finished goes where its newest step is)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from types import MappingProxyType

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cluster.protocol.config import Limits
from cluster.scheduler.machine.state import (
    Accepted,
    Effect,
    Evict,
    Member,
    NodeFailedEvent,
    NodeRole,
    NodeState,
    Phase,
    Refusal,
    Refused,
    Registration,
    SchedulerState,
    ShutdownEvent,
    TopologyReadyEvent,
)
from tests.unit.test_state import JOB, FakeClock, accept, make_state, reg

GUARD = 10.0  # make_state's MS_NODE_TIMEOUT


def spare_reg(state: SchedulerState, node_id: str, **kwargs: object) -> Registration:
    return dataclasses.replace(reg(state, node_id, **kwargs), spare=True)  # type: ignore[arg-type]


def job(
    clock: FakeClock,
    n: int = 3,
    spares: tuple[str, ...] = ("s0",),
    servers: tuple[str, ...] = (),
    hosts: Mapping[str, str] = MappingProxyType({}),
    **kw: object,
) -> SchedulerState:
    """A formed job of `n` workers (and `servers`, with server_num= among `kw`) with recovery,
    and these spares registered and connected; each node on its host in `hosts` (else h0)."""
    state = make_state(clock, worker_num=n, recovery=True, **kw)  # type: ignore[arg-type]
    for node_id in spares:
        host = hosts.get(node_id, "h0")
        outcome, _ = state.register(spare_reg(state, node_id, port=7000, host=host))
        assert isinstance(outcome, Accepted)
        assert outcome.spare
        state.connect(node_id, 1)
    ranked = [(str(i), NodeRole.WORKER) for i in range(n)]
    for i, (node_id, role) in enumerate([*ranked, *((s, NodeRole.SERVER) for s in servers)]):
        host = hosts.get(node_id, "h0")
        outcome, _ = state.register(reg(state, node_id, port=6000 + i, role=role, host=host))
        assert isinstance(outcome, Accepted)
        assert not outcome.spare
        state.connect(node_id, 1)
    assert state.phase is Phase.READY
    return state


def ready_events(effects: list[Effect]) -> list[TopologyReadyEvent]:
    return [e for e in effects if isinstance(e, TopologyReadyEvent)]


def test_a_spare_holds_no_rank_and_is_not_counted_in_ms_worker_num() -> None:
    state = job(FakeClock(), 2, ("s0", "s1"))
    assert [p.node_id for p in state.peers()] == ["0", "1"]
    assert set(state.spares) == {"s0", "s1"}
    assert all(m.rank is None for m in state.spares.values())


def test_a_failed_rank_goes_to_a_live_spare_at_once_with_a_new_generation() -> None:
    state = job(FakeClock())
    state.report_checkpoints("0", 1, [5, 10])
    state.report_checkpoints("1", 1, [5, 10])
    state.report_checkpoints("2", 1, [5])
    effects = state.disconnect("1", 1)
    assert isinstance(effects[0], NodeFailedEvent)
    assert Evict("1", 1, effects[0].reason) in effects
    (ready,) = ready_events(effects)
    assert (ready.generation, ready.promoted, ready.rollback_step) == (2, "s0", 5)
    assert [(p.rank, p.node_id) for p in ready.peers] == [(0, "0"), (1, "s0"), (2, "2")]
    # The spare holds rank 1's files from now on; the failed id waits out its guard as a spare.
    assert state.members["s0"].checkpoints == (5, 10)
    assert state.spares["1"].state is NodeState.FAILED
    assert state.spares["1"].rank is None
    assert state.pool.promotions == 1


def test_the_failed_id_stays_refused_for_the_guard_then_comes_back_as_a_spare() -> None:
    clock = FakeClock()
    state = job(clock)
    state.disconnect("1", 1)
    clock.advance(GUARD - 1)
    outcome, effects = state.register(reg(state, "1", incarnation=2, cluster_id=JOB))
    assert isinstance(outcome, Refused)
    assert outcome.reason is Refusal.NODE_ALIVE
    assert effects == []
    clock.advance(1.5)
    generation = state.generation
    outcome, effects = state.register(reg(state, "1", incarnation=2, cluster_id=JOB))
    assert isinstance(outcome, Accepted)
    assert outcome.spare
    assert not outcome.rejoined
    assert ready_events(effects) == []  # no new generation
    assert state.generation == generation
    assert state.spares["1"].state is NodeState.ALIVE
    assert state.spares["1"].restarts == 1


def test_with_no_spare_todays_path_and_a_spare_arriving_takes_the_down_rank() -> None:
    clock = FakeClock()
    state = job(clock, spares=())
    effects = state.disconnect("2", 1)
    assert ready_events(effects) == []
    assert state.members["2"].state is NodeState.FAILED
    outcome, effects = state.register(spare_reg(state, "s9"))
    assert isinstance(outcome, Accepted)
    assert outcome.spare
    (ready,) = ready_events(effects)
    assert ready.promoted == "s9"
    assert state.members["s9"].rank == 2


def test_a_failed_parameter_servers_rank_waits_for_its_node_not_for_a_spare() -> None:
    """Spares are workers: a server's rank given to one made two workers hold rank 0 and left
    the job without a server, in the published generation and in the saved state."""
    clock = FakeClock()
    state = job(clock, 2, server_num=1, servers=("ps0",))
    effects = state.disconnect("ps0", 1)
    assert ready_events(effects) == []
    assert isinstance(effects[0], NodeFailedEvent)
    assert state.generation == 1
    assert state.members["ps0"].state is NodeState.FAILED
    assert state.spares["s0"].state is NodeState.ALIVE
    assert state.spares["s0"].rank is None
    assert state.pool.promotions == 0
    # A spare registering meanwhile stays a spare too; the server's node takes its rank back.
    outcome, effects = state.register(spare_reg(state, "s1", port=7001))
    assert isinstance(outcome, Accepted)
    assert outcome.spare
    assert ready_events(effects) == []
    clock.advance(GUARD + 0.1)
    server = reg(state, "ps0", incarnation=2, role=NodeRole.SERVER, port=6100, cluster_id=JOB)
    outcome, effects = state.register(server)
    assert isinstance(outcome, Accepted)
    assert outcome.rejoined
    (ready,) = ready_events(effects)
    assert [(p.node_id, p.role, p.rank) for p in ready.peers] == [
        ("0", NodeRole.WORKER, 0),
        ("1", NodeRole.WORKER, 1),
        ("ps0", NodeRole.SERVER, 0),
    ]


def test_two_failures_with_one_spare_the_second_waits_for_the_first_back_as_a_spare() -> None:
    clock = FakeClock()
    state = job(clock)
    state.disconnect("1", 1)  # s0 takes rank 1
    effects = state.disconnect("2", 1)  # no spare left: rank 2 waits
    assert ready_events(effects) == []
    clock.advance(GUARD + 0.1)
    outcome, effects = state.register(reg(state, "1", incarnation=2, cluster_id=JOB))
    assert isinstance(outcome, Accepted)
    assert outcome.spare
    (ready,) = ready_events(effects)
    assert ready.promoted == "1"
    assert state.members["1"].rank == 2
    assert state.generation == 3
    assert sorted(p.rank for p in ready.peers) == [0, 1, 2]


def test_a_spare_that_dies_is_just_gone() -> None:
    clock = FakeClock()
    state = job(clock, spares=("s0", "s1"))
    assert state.disconnect("s0", 1) == []
    # Nobody waits for it; its id stays refused for the guard, like any node's.
    assert state.spares["s0"].state is NodeState.FAILED
    assert state.generation == 1
    clock.advance(GUARD + 0.1)
    for i in range(3):
        state.heartbeat(str(i), 1)
    assert state.tick() == []  # s1 went silent: gone too, nobody told
    assert state.spares["s1"].state is NodeState.FAILED
    assert "s0" not in state.spares
    clock.advance(GUARD + 0.1)
    for i in range(3):
        state.heartbeat(str(i), 1)
    assert state.tick() == []
    assert state.spares == {}
    assert state.phase is Phase.READY


def test_without_heartbeats_a_spare_is_not_taken_for_dead_by_its_silence() -> None:
    """With MS_DISABLE_HEARTBEAT=1 nobody beats: every spare was declared dead and dropped
    after MS_NODE_TIMEOUT, and a failed worker's rank then waited for its node. Its broken
    stream still tells that a spare died."""
    clock = FakeClock()
    state = job(clock, 2, ("s0", "s1"), heartbeat_enabled=False)
    for _ in range(300):  # 30 s of ticks, no heartbeat from anyone
        clock.advance(0.1)
        assert state.tick() == []
    assert {n: m.state for n, m in state.spares.items()} == {
        "s0": NodeState.ALIVE,
        "s1": NodeState.ALIVE,
    }
    (ready,) = ready_events(state.disconnect("1", 1))
    assert ready.promoted == "s0"
    assert state.disconnect("s1", 1) == []
    assert state.spares["s1"].state is NodeState.FAILED


def test_a_spare_restarted_while_the_job_forms_is_a_spare_again() -> None:
    """A new process of a spare's id, past its guard while the job still forms, was answered as
    a ranked worker (spare=False) and its record stayed failed: its stream was refused, or it
    waited for a topology that never named it."""
    clock = FakeClock()
    state = make_state(clock, worker_num=2, recovery=True)
    accept(state, spare_reg(state, "s0"))
    state.connect("s0", 1)
    state.disconnect("s0", 1)  # the spare's process dies while the job forms
    assert state.spares["s0"].state is NodeState.FAILED
    clock.advance(GUARD + 1)
    outcome, effects = state.register(spare_reg(state, "s0", incarnation=2))
    assert isinstance(outcome, Accepted)
    assert outcome.spare
    assert effects == [Evict("s0", 1, "replaced by a new process")]
    spare = state.spares["s0"]
    assert (spare.state, spare.failure, spare.incarnation) == (NodeState.ALIVE, "", 2)
    state.connect("s0", 2)  # its stream opens
    for node_id in ("0", "1"):
        accept(state, reg(state, node_id, port=6000 + int(node_id)))
    assert state.phase is Phase.READY
    assert [p.node_id for p in state.peers()] == ["0", "1"]
    (ready,) = ready_events(state.disconnect("1", 1))
    assert ready.promoted == "s0"


def _tables(state: SchedulerState) -> dict[str, int]:
    """The size of everything the machine keeps by node id."""
    return {
        "members": len(state.members),
        "spares": len(state.spares),
        "call windows": len(state.admission.call_windows),
        "put back": len(state.rollback._put_back),
        "report numbers": len(state.rollback._report_seq),
        "guard waiting": len(state.guard_waiting),
        "awaiting": len(state.awaiting),
    }


def test_node_ids_that_come_and_go_leave_nothing_behind() -> None:
    """Spares with ids of their own (a host's name and a process id) register, report, and
    finish, or die and wait out their guard: every table keyed by node id is back to its size
    once they are gone (20,000 of them left 20,002 call windows and 8 MB behind)."""
    clock = FakeClock()
    state = job(clock, 2, spares=(), job_secret=b"s" * 32)
    for node_id in ("0", "1"):
        state.report_checkpoints(node_id, 1, [10], state.generation, 1)
    before = _tables(state)
    for i in range(50):
        leaving, dying = f"host-{i}-finishes", f"host-{i}-dies"
        for node_id in (leaving, dying):
            accept(state, reg(state, node_id, spare=True, port=7000))
            state.connect(node_id, 1)
            state.report_checkpoints(node_id, 1, [], state.generation, 1)
        state.finish(leaving, 1)
        state.disconnect(dying, 1)
        outcome, _ = state.register(reg(state, dying, incarnation=2, spare=True, port=7000))
        assert isinstance(outcome, Refused)  # its new process waits out the guard
        assert outcome.reason is Refusal.NODE_ALIVE
        clock.advance(GUARD + 0.5)
        for node_id in ("0", "1"):
            state.heartbeat(node_id, 1)
        assert state.tick() == []  # the dead spare's record expires
        assert _tables(state) == before, i


def test_spares_are_capped() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=2, recovery=True)
    state = dataclasses.replace(
        state, settings=dataclasses.replace(state.settings, limits=Limits(max_spares=2))
    )
    for node_id in ("s0", "s1"):
        assert isinstance(state.register(spare_reg(state, node_id))[0], Accepted)
    before = json.dumps(state.snapshot(), sort_keys=True), set(state.spares)
    outcome, effects = state.register(spare_reg(state, "s2"))
    assert isinstance(outcome, Refused)
    assert outcome.reason is Refusal.CLUSTER_FULL
    assert "CLUSTER_MAX_SPARES=2" in outcome.message
    assert effects == []
    assert (json.dumps(state.snapshot(), sort_keys=True), set(state.spares)) == before


def test_a_spare_needs_recovery() -> None:
    state = make_state(FakeClock(), worker_num=2)
    outcome, _ = state.register(spare_reg(state, "s0"))
    assert isinstance(outcome, Refused)
    assert "MS_ENABLE_RECOVERY" in outcome.message
    assert state.spares == {}


def test_a_live_spares_id_cannot_be_claimed() -> None:
    clock = FakeClock()
    state = job(clock)
    clock.advance(GUARD - 2)
    state.heartbeat("s0", 1)
    for forged in (spare_reg(state, "s0", incarnation=7), reg(state, "s0", incarnation=7)):
        outcome, effects = state.register(forged)
        assert isinstance(outcome, Refused)
        assert outcome.reason is Refusal.NODE_ALIVE
        assert effects == []
    # The same incarnation from elsewhere, or with another credential: a forgery.
    outcome, _ = state.register(spare_reg(state, "s0", port=7999))
    assert isinstance(outcome, Refused)
    assert outcome.reason is Refusal.UNAUTHENTICATED
    assert state.spares["s0"].incarnation == 1
    assert state.spares["s0"].port == 7000


def test_a_cut_off_ranked_node_whose_rank_went_to_a_spare_is_told_to_restart() -> None:
    clock = FakeClock()
    state = job(clock)
    clock.advance(GUARD + 0.5)
    for node_id in ("0", "2", "s0"):
        state.heartbeat(node_id, 1)
    state.tick()  # "1" went silent: s0 took its rank
    outcome, _ = state.register(reg(state, "1", incarnation=1, port=6001))
    assert isinstance(outcome, Refused)
    assert outcome.reason is Refusal.JOB_OVER
    assert "went to a spare" in outcome.message
    assert state.members["s0"].rank == 1


def test_the_end_of_the_job_is_told_to_spares_and_refuses_waiting_nodes_as_finished() -> None:
    clock = FakeClock()
    state = job(clock)
    state.disconnect("1", 1)
    for node_id in ("0", "s0"):
        state.finish(node_id, 1)
    effects = state.finish("2", 1)
    assert effects == [ShutdownEvent(True, "all 3 nodes finished")]
    outcome, _ = state.register(reg(state, "1", incarnation=2, cluster_id=JOB))
    assert isinstance(outcome, Refused)
    assert outcome.reason is Refusal.JOB_FINISHED


def test_a_rank_that_fails_once_every_other_worker_finished_waits_for_its_node() -> None:
    """Every other worker has finished (past the end, its state server stopped): a spare could
    fetch the rank's state from nobody, so none takes it, and none that arrives meanwhile; the
    rank waits for its node, which rejoins after its guard and finishes the job."""
    clock = FakeClock()
    state = job(clock)
    for node_id in ("0", "1", "2"):
        state.report_checkpoints(node_id, 1, [4])
    for node_id in ("0", "2"):
        assert state.finish(node_id, 1) == []
    effects = state.disconnect("1", 1)
    assert ready_events(effects) == []
    assert (state.members["1"].state, state.members["1"].rank) == (NodeState.FAILED, 1)
    outcome, effects = state.register(spare_reg(state, "s1", port=7001))
    assert isinstance(outcome, Accepted)
    assert outcome.spare
    assert ready_events(effects) == []
    assert state.pool.promotions == 0
    clock.advance(GUARD + 0.1)
    outcome, effects = state.register(reg(state, "1", incarnation=2, cluster_id=JOB))
    assert isinstance(outcome, Accepted)
    assert outcome.rejoined
    assert ready_events(effects)[0].promoted == ""
    state.connect("1", 2)
    assert state.finish("1", 2) == [ShutdownEvent(True, "all 3 nodes finished")]


def test_a_promoted_spare_that_fails_once_the_others_finished_gives_the_rank_back() -> None:
    """A spare took rank 1 while rank 0 was at work, and failed (it could not fetch the state)
    once rank 0 had finished: no other spare takes the rank, but its previous holder, back as
    a spare after its guard, does (its files hold the rank's state), also from a restarted
    scheduler."""
    clock = FakeClock()
    state = job(clock, 2, spares=("s0", "s1"))
    for node_id in ("0", "1"):
        state.report_checkpoints(node_id, 1, [4])
    (ready,) = ready_events(state.disconnect("1", 1))
    assert ready.promoted == "s0"
    state.connect("s0", 1)
    state.finish("0", 1)
    assert ready_events(state.disconnect("s0", 1)) == []
    assert state.spares["s1"].rank is None
    saved = json.loads(json.dumps(state.snapshot()))
    state = SchedulerState.restore(saved, state.settings, clock, new_cluster_id="next")
    clock.advance(GUARD + 0.1)
    outcome, effects = state.register(reg(state, "1", incarnation=2, cluster_id=JOB))
    assert isinstance(outcome, Accepted)
    (ready,) = ready_events(effects)
    assert (ready.promoted, state.members["1"].rank) == ("1", 1)


def test_a_promoted_spare_that_trained_past_its_previous_holders_files_keeps_the_rank() -> None:
    """Spare s0 took rank 1 at step 4 (the newest node '1' had reported), trained on to step 8
    on its own disk, and failed once rank 0 had finished: node '1', back as a spare after its
    guard, does not take the rank back (its files hold step 4 only, and no peer is left to give
    it step 8); the rank waits for s0's node, which rejoins with it, also from a restarted
    scheduler (the step node '1' held is saved with s0's record)."""
    clock = FakeClock()
    state = job(clock, 2, spares=("s0",))
    for node_id in ("0", "1"):
        state.report_checkpoints(node_id, 1, [4])
    (ready,) = ready_events(state.disconnect("1", 1))
    assert ready.promoted == "s0"
    state.connect("s0", 1)
    for node_id in ("0", "s0"):
        state.report_checkpoints(node_id, 1, [4, 8])
    state.finish("0", 1)
    assert ready_events(state.disconnect("s0", 1)) == []
    saved = json.loads(json.dumps(state.snapshot()))
    state = SchedulerState.restore(saved, state.settings, clock, new_cluster_id="next")
    clock.advance(GUARD + 0.1)
    outcome, effects = state.register(reg(state, "1", incarnation=2, cluster_id=JOB))
    assert isinstance(outcome, Accepted)
    assert outcome.spare
    assert ready_events(effects) == []
    assert (state.members["s0"].state, state.members["s0"].rank) == (NodeState.FAILED, 1)
    outcome, effects = state.register(spare_reg(state, "s0", incarnation=2, cluster_id=JOB))
    assert isinstance(outcome, Accepted)
    assert outcome.rejoined
    (ready,) = ready_events(effects)
    assert (ready.promoted, ready.rollback_step, state.members["s0"].rank) == ("", 8, 1)


def test_a_saved_spare_without_its_previous_holders_step_keeps_the_rank_for_its_node() -> None:
    """A snapshot of a scheduler that did not record the step (`took_over_step` absent):
    nothing shows that node '1''s files hold the rank's newest step, so it does not take the
    rank back once the others finished."""
    clock = FakeClock()
    state = job(clock, 2, spares=("s0",))
    for node_id in ("0", "1"):
        state.report_checkpoints(node_id, 1, [4])
    state.disconnect("1", 1)
    state.connect("s0", 1)
    state.finish("0", 1)
    state.disconnect("s0", 1)
    saved = json.loads(json.dumps(state.snapshot()))
    for member in saved["members"]:
        del member["took_over_step"]
    state = SchedulerState.restore(saved, state.settings, clock, new_cluster_id="next")
    assert state.members["s0"].took_over_step == -1
    clock.advance(GUARD + 0.1)
    outcome, effects = state.register(reg(state, "1", incarnation=2, cluster_id=JOB))
    assert isinstance(outcome, Accepted)
    assert outcome.spare
    assert ready_events(effects) == []


def test_a_rank_that_reported_no_checkpoint_goes_to_a_spare_once_the_others_finished() -> None:
    """Its state is not in its node's files (its ranks work alone, or keep their state
    elsewhere): a spare takes it at once, as ever."""
    state = job(FakeClock())
    for node_id in ("0", "2"):
        state.finish(node_id, 1)
    (ready,) = ready_events(state.disconnect("1", 1))
    assert ready.promoted == "s0"


def test_a_rank_that_fails_while_another_worker_is_still_at_work_goes_to_a_spare() -> None:
    state = job(FakeClock())
    state.finish("0", 1)
    (ready,) = ready_events(state.disconnect("1", 1))
    assert ready.promoted == "s0"


def test_a_restarted_scheduler_knows_its_spares() -> None:
    clock = FakeClock()
    state = job(clock, spares=("s0", "s1"))
    state.disconnect("1", 1)
    restored = SchedulerState.restore(
        json.loads(json.dumps(state.snapshot())), state.settings, clock, new_cluster_id="other"
    )
    assert set(restored.spares) == {"s1", "1"}
    assert restored.spares["1"].state is NodeState.FAILED
    assert restored.members["s0"].rank == 1
    assert isinstance(restored.register(spare_reg(restored, "s1", port=7000))[0], Accepted)


def local_places(state: SchedulerState) -> dict[str, tuple[str, int, int]]:
    """Each ranked worker's (host, local rank, local size), as the generation publishes it."""
    return {p.node_id: (p.host, p.local_rank, p.local_size) for p in state.peers()}


def test_a_spare_promoted_onto_another_host_takes_a_free_local_rank_there() -> None:
    """The review's case: workers 0 and 1 on h1, worker 2 and the spare on h2; 0 dies. The
    spare took local rank 0 beside worker 2, which had bound device 0 in generation 1 and was
    told local rank 1 in generation 2; two ranks of h2 then used one GPU ("Duplicate GPU
    detected"). The survivors keep their local ranks; only the local sizes follow."""
    hosts = {"0": "h1", "1": "h1", "2": "h2", "s0": "h2"}
    state = job(FakeClock(), 3, ("s0",), hosts=hosts)
    assert local_places(state) == {"0": ("h1", 0, 2), "1": ("h1", 1, 2), "2": ("h2", 0, 1)}
    (ready,) = ready_events(state.disconnect("0", 1))
    assert ready.promoted == "s0"
    assert {p.node_id: (p.host, p.local_rank, p.local_size) for p in ready.peers} == {
        "s0": ("h2", 1, 2),  # rank 0 now, on worker 2's host: the free local rank
        "1": ("h1", 1, 1),  # its device stays 1: alone on h1, a gap at 0
        "2": ("h2", 0, 2),
    }


def test_spares_on_a_host_of_their_own_never_share_a_local_rank() -> None:
    """Two spares on host sp take ranks 2 then 0: the second takes local rank 1, the first
    keeps 0 (by rank order it was renumbered to 1 while its process had bound device 0)."""
    hosts = {"0": "h1", "1": "h1", "2": "h2", "s0": "sp", "s1": "sp"}
    state = job(FakeClock(), 3, ("s0", "s1"), hosts=hosts)
    state.disconnect("2", 1)
    assert local_places(state)["s0"] == ("sp", 0, 1)
    state.disconnect("0", 1)
    places = local_places(state)
    assert (places["s0"], places["s1"]) == (("sp", 0, 2), ("sp", 1, 2))
    assert places["1"] == ("h1", 1, 1)


def test_a_spare_on_the_failed_workers_host_takes_its_local_rank_back() -> None:
    """The spare of the failed worker's own host takes the local rank it freed."""
    hosts = {"0": "h1", "1": "h1", "2": "h1", "s0": "h1"}
    state = job(FakeClock(), 3, ("s0",), hosts=hosts)
    state.disconnect("1", 1)
    assert local_places(state) == {"0": ("h1", 0, 3), "s0": ("h1", 1, 3), "2": ("h1", 2, 3)}


# -- the machine -------------------------------------------------------------------------------

N = 3
SERVER = "ps0"  # the job's one parameter server: its rank is never a spare's
IDS = [str(i) for i in range(N)] + ["s0", "s1", "s2", SERVER]
HOSTS = st.sampled_from(["h0", "h1", "h2"])


class SparesMachine(RuleBasedStateMachine):
    """Workers, a parameter server and spares join, die, come back (perhaps on another host)
    and get promoted; time passes."""

    @initialize(
        spares=st.integers(min_value=0, max_value=3),
        forming=st.booleans(),
        hosts=st.lists(HOSTS, min_size=len(IDS), max_size=len(IDS)),
    )
    def start(self, spares: int, forming: bool, hosts: list[str]) -> None:
        """A formed job, or (`forming`) only its spares so far: its nodes join by `restart`."""
        self.clock = FakeClock()
        spare_ids = tuple(f"s{i}" for i in range(spares))
        placed = dict(zip(IDS, hosts, strict=True))
        if forming:
            self.state = make_state(self.clock, worker_num=N, server_num=1, recovery=True)
            for node_id in spare_ids:
                registration = spare_reg(self.state, node_id, port=7000, host=placed[node_id])
                accept(self.state, registration)
                self.state.connect(node_id, 1)
        else:
            self.state = job(
                self.clock, N, spare_ids, servers=(SERVER,), server_num=1, hosts=placed
            )
        self.incarnations = {node_id: 1 for node_id in IDS}
        # The local rank each running process (node id, incarnation) had when it first held a
        # rank: the device it bound.
        self.bound: dict[tuple[str, int], int] = {}
        # When each id was last seen alive before it failed (its guard runs from there).
        self.failed_at: dict[str, float] = {}
        # The newest checkpoint step each worker rank reached, and the newest each node id's
        # files hold: those it reported, and those it got with a rank it took.
        self.reached: dict[int, int] = {}
        self.disk: dict[str, int] = {}

    def _live(self) -> list[str]:
        everyone = [*self.state.members.values(), *self.state.spares.values()]
        return [m.node_id for m in everyone if m.state is NodeState.ALIVE]

    @rule(index=st.integers(min_value=0, max_value=10))
    def kill(self, index: int) -> None:
        live = self._live()
        if not live or self.state.phase not in (Phase.WAITING, Phase.READY):
            return
        node_id = live[index % len(live)]
        member = self.state.find(node_id)
        assert member is not None
        self._promotions(self.state.disconnect(node_id, member.incarnation))
        if self.state.find(node_id) is not None:  # not forgotten (while forming): guarded
            self.failed_at[node_id] = self.clock()

    def _at_work(self) -> list[Member]:
        """The live ranked workers of a formed job."""
        if self.state.phase is not Phase.READY:
            return []
        members = self.state.members.values()
        return [m for m in members if m.role is NodeRole.WORKER and m.state is NodeState.ALIVE]

    @rule(index=st.integers(min_value=0, max_value=10))
    def save(self, index: int) -> None:
        """A live ranked worker saves a step newer than any its rank reached, and reports it."""
        at_work = self._at_work()
        if not at_work:
            return
        member = at_work[index % len(at_work)]
        assert member.rank is not None
        step = self.reached.get(member.rank, 0) + 4
        self.state.report_checkpoints(member.node_id, member.incarnation, [step])
        self.reached[member.rank] = self.disk[member.node_id] = step

    @rule(index=st.integers(min_value=0, max_value=10), others=st.booleans())
    def finish(self, index: int, others: bool) -> None:
        """A live ranked worker finishes; or (`others`) every live ranked worker but that one."""
        at_work = self._at_work()
        if not at_work:
            return
        chosen = at_work[index % len(at_work)]
        for member in [m for m in at_work if m is not chosen] if others else [chosen]:
            self.state.finish(member.node_id, member.incarnation)

    def _promotions(self, effects: list[Effect]) -> None:
        """A spare given a rank once every other worker has finished, when no peer is left to
        give it the rank's state, holds the rank's newest step in its files; a promoted spare
        holds the steps reported for its rank from then on."""
        for ready in ready_events(effects):
            promoted = self.state.members.get(ready.promoted)
            if promoted is None or promoted.rank is None:
                continue
            workers = [m for m in self.state.members.values() if m.role is NodeRole.WORKER]
            reached = self.reached.get(promoted.rank, -1)
            if all(m.state is NodeState.FINISHED for m in workers if m is not promoted):
                assert self.disk.get(promoted.node_id, -1) >= reached, (promoted, reached)
            self.disk[promoted.node_id] = max(self.disk.get(promoted.node_id, -1), reached)

    @rule(node_id=st.sampled_from(IDS), spare=st.booleans(), host=HOSTS)
    def restart(self, node_id: str, spare: bool, host: str) -> None:
        self.incarnations[node_id] += 1
        role = NodeRole.SERVER if node_id == SERVER else NodeRole.WORKER
        incarnation = self.incarnations[node_id]
        registration = reg(
            self.state, node_id, incarnation=incarnation, cluster_id=JOB, role=role, host=host
        )
        registration = dataclasses.replace(registration, spare=spare)
        before = json.dumps(self.state.snapshot(), sort_keys=True)
        outcome, effects = self.state.register(registration)
        if isinstance(outcome, Refused):
            assert effects == []
            assert json.dumps(self.state.snapshot(), sort_keys=True) == before
            return
        self._promotions(effects)
        # Taken: a live node, a spare exactly when the scheduler keeps it among the spares (or
        # it took a down rank at once).
        promoted = any(e.promoted == node_id for e in ready_events(effects))
        assert outcome.spare is (node_id in self.state.spares or promoted)
        member = self.state.find(node_id)
        assert member is not None
        assert (member.state, member.failure) == (NodeState.ALIVE, "")
        self.state.connect(node_id, self.incarnations[node_id])

    @rule(seconds=st.sampled_from([1.0, 6.0, 11.0]), tick=st.booleans())
    def time_passes(self, seconds: float, tick: bool) -> None:
        """Without `tick`, what comes next comes before the scheduler's next tick looks (a
        node told to retry when its guard ends registers just then)."""
        self.clock.advance(seconds)
        for node_id in self._live():
            member = self.state.find(node_id)
            assert member is not None
            self.state.heartbeat(node_id, member.incarnation)
        if tick:
            self._promotions(self.state.tick())

    @rule()
    def scheduler_restarts(self) -> None:
        """From its own snapshot; the live nodes reconnect (their guard starts afresh). A job
        that had not formed, or had ended, is not resumed: its nodes are new to the next."""
        saved = json.loads(json.dumps(self.state.snapshot()))
        settings, resumed = self.state.settings, self.state.phase is Phase.READY
        self.state = SchedulerState.restore(saved, settings, self.clock, new_cluster_id="next")
        if resumed:
            assert {m["node_id"] for m in saved["spares"]} == set(self.state.spares)
        else:
            self.failed_at.clear()
            self.bound.clear()
        for node_id in self._live():
            member = self.state.find(node_id)
            assert member is not None
            self.state.connect(node_id, member.incarnation)

    @invariant()
    def ranks_never_change_and_have_at_most_one_live_holder(self) -> None:
        if self.state.generation == 0:  # not formed (yet, or ever)
            return
        for role, space in ((NodeRole.WORKER, N), (NodeRole.SERVER, 1)):
            ranks = [m.rank for m in self.state.members.values() if m.role is role]
            assert sorted(r for r in ranks if r is not None) == list(range(space)), role
        assert all(m.rank is None for m in self.state.spares.values())
        assert not set(self.state.members) & set(self.state.spares)

    @invariant()
    def a_guarded_id_never_holds_a_rank(self) -> None:
        for node_id, member in self.state.members.items():
            failed = self.failed_at.get(node_id)
            if member.state is NodeState.ALIVE and failed is not None:
                # Back with a rank: only after its guard (or it is the same process, which a
                # disconnect in this machine never is).
                assert self.clock() - failed >= GUARD

    @invariant()
    def local_ranks_follow_the_new_placement(self) -> None:
        """Among the ranked members of a role on a host, no two share a local rank and each
        one's local size is their number; a process that goes on keeps its local rank (its
        device is bound), whoever is promoted or moves beside it."""
        if self.state.generation == 0:  # not formed: nobody has a local rank yet
            return
        on_host: dict[tuple[NodeRole, str], list[Member]] = {}
        for m in self.state.members.values():
            on_host.setdefault((m.role, m.host), []).append(m)
        for where, group in on_host.items():
            local_ranks = sorted(m.local_rank for m in group)
            assert len(set(local_ranks)) == len(group), (where, local_ranks)
            assert {m.local_size for m in group} == {len(group)}, where
        for m in self.state.members.values():
            if m.state is NodeState.ALIVE:
                bound = self.bound.setdefault((m.node_id, m.incarnation), m.local_rank)
                assert m.local_rank == bound, (m.node_id, m.incarnation)

    @invariant()
    def spares_are_bounded(self) -> None:
        assert len(self.state.spares) <= self.state.settings.limits.max_spares


TestSparesMachine = SparesMachine.TestCase
TestSparesMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
