"""Unit and property tests of cluster.state.SchedulerState, driven with a fake clock."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cluster.protocol import auth, version
from cluster.protocol.backoff import guard_poll_s
from cluster.protocol.config import canonical_node_id
from cluster.protocol.errors import EvictedError, SnapshotError, UnknownNodeError
from cluster.protocol.records import GUARD_POLL_MARGIN_S
from cluster.protocol.settings import JobSettings
from cluster.protocol.version import PROTOCOL_REVISION, VERSION
from cluster.scheduler.machine.rollback import HELD_BY_ALL_EVERY_S
from cluster.scheduler.machine.snapshot import restored_note
from cluster.scheduler.machine.state import (
    Accepted,
    Denial,
    Denied,
    Effect,
    Evict,
    NoCommonStep,
    NodeFailedEvent,
    NodeRole,
    NodeState,
    Phase,
    ProgressEvent,
    Refusal,
    Refused,
    Registration,
    SchedulerState,
    ShutdownEvent,
    TopologyReadyEvent,
)
from tests.conftest import FakeClock
from tests.credentials import digest, presented

JOB = "job-1"


# The job's settings in these tests, unless a test says otherwise (`make_state(**changes)`).
SETTINGS = JobSettings(
    worker_num=4,
    server_num=0,
    node_timeout_s=10.0,
    topo_timeout_s=60.0,
    heartbeat_interval_s=1.0,
    heartbeat_enabled=True,
    recovery=False,
    job_secret=None,
)


def make_state(clock: FakeClock, **changes: Any) -> SchedulerState:
    """A state machine of job JOB with SETTINGS, but for `changes` (worker_num=2, ...)."""
    return SchedulerState(JOB, dataclasses.replace(SETTINGS, **changes), clock)


_nonces = itertools.count(1)


def reg(
    state: SchedulerState, node_id: str, *, secret: bytes | None = None, **fields: Any
) -> Registration:
    """The registration of the process (node_id, incarnation), with its own credential; with a
    job secret (the state's, unless `secret` says otherwise), a fresh nonce and the proof.
    `fields`: the Registration's fields that differ from a worker's of this job on host h0,
    port 5000, incarnation 1 (host=, role=, incarnation=, port=, worker_num=, ...)."""
    incarnation = int(fields.get("incarnation", 1))
    registration = Registration(
        **{
            "node_id": node_id,
            "role": NodeRole.WORKER,
            "host": "h0",
            "port": 5000,
            "incarnation": incarnation,
            "worker_num": state.settings.worker_num,
            "server_num": state.settings.server_num,
            "cluster_id": "",
            "credential_digest": digest(node_id, incarnation),
            "protocol_revision": PROTOCOL_REVISION,
            **{k: v for k, v in fields.items() if v is not None},
        }
    )
    secret = state.settings.job_secret if secret is None else secret
    if secret is None:
        return registration
    registration = dataclasses.replace(
        registration,
        nonce=next(_nonces).to_bytes(auth.NONCE_BYTES, "big"),
        challenge=state.admission.challenge(),  # the answer of the scheduler's Challenge
        job_id=state.cluster_id,
    )
    return dataclasses.replace(registration, proof=auth.prove(secret, registration.message()))


def accept(state: SchedulerState, registration: Registration) -> list[Effect]:
    outcome, effects = state.register(registration)
    assert isinstance(outcome, Accepted), outcome
    return effects


def refuse(state: SchedulerState, registration: Registration, reason: Refusal) -> Refused:
    before = {k: (m.incarnation, m.state) for k, m in state.members.items()}
    phase = state.phase
    outcome, effects = state.register(registration)
    assert isinstance(outcome, Refused), outcome
    assert outcome.reason is reason
    assert outcome.message.strip()
    assert effects == []
    # A refusal changes nothing.
    assert {k: (m.incarnation, m.state) for k, m in state.members.items()} == before
    assert state.phase is phase
    return outcome


def ready_state(
    clock: FakeClock, ids: list[str], hosts: list[str] | None = None, **kwargs: object
) -> SchedulerState:
    state = make_state(clock, worker_num=len(ids), **kwargs)  # type: ignore[arg-type]
    for i, node_id in enumerate(ids):
        accept(state, reg(state, node_id, host=(hosts[i] if hosts else "h0"), port=6000 + i))
    assert state.phase is Phase.READY
    return state


def ranks(state: SchedulerState) -> dict[str, int | None]:
    return {m.node_id: m.rank for m in state.members.values()}


# -- ranks ------------------------------------------------------------------------------------


def test_numeric_node_ids_are_the_ranks() -> None:
    state = ready_state(FakeClock(), ["3", "1", "0", "2"])
    assert ranks(state) == {"0": 0, "1": 1, "2": 2, "3": 3}
    assert [(p.rank, p.node_id) for p in state.peers()] == [(i, str(i)) for i in range(4)]


def test_numeric_node_ids_are_canonical() -> None:
    state = ready_state(FakeClock(), ["001", "0"])
    assert ranks(state) == {"0": 0, "1": 1}
    assert state.member("01", 1).rank == 1


def test_non_numeric_ids_are_ranked_by_host_then_id() -> None:
    state = ready_state(FakeClock(), ["b", "a", "z", "c"], hosts=["h2", "h2", "h1", "h1"])
    assert ranks(state) == {"c": 0, "z": 1, "a": 2, "b": 3}
    assert [(p.rank, p.node_id, p.host) for p in state.peers()] == [
        (0, "c", "h1"),
        (1, "z", "h1"),
        (2, "a", "h2"),
        (3, "b", "h2"),
    ]


def test_mixed_ids_fill_the_free_ranks() -> None:
    state = ready_state(FakeClock(), ["2", "x", "a", "m"], hosts=["h9", "h1", "h1", "h0"])
    # '2' keeps rank 2; the others take 0, 1, 3 in (host, id) order.
    assert ranks(state) == {"2": 2, "m": 0, "a": 1, "x": 3}


def test_local_rank_and_size_grouped_by_host() -> None:
    state = ready_state(
        FakeClock(), ["0", "1", "2", "3", "4"], hosts=["h1", "h0", "h1", "h1", "h0"]
    )
    local = {p.rank: (p.host, p.local_rank, p.local_size) for p in state.peers()}
    assert local == {
        0: ("h1", 0, 3),
        1: ("h0", 0, 2),
        2: ("h1", 1, 3),
        3: ("h1", 2, 3),
        4: ("h0", 1, 2),
    }


def test_non_numeric_workers_of_a_host_are_contiguous() -> None:
    state = ready_state(
        FakeClock(), ["w3", "w0", "w2", "w1"], hosts=["hostB", "hostA", "hostB", "hostA"]
    )
    local = {p.node_id: (p.rank, p.local_rank, p.local_size) for p in state.peers()}
    assert local == {
        "w0": (0, 0, 2),
        "w1": (1, 1, 2),
        "w2": (2, 0, 2),
        "w3": (3, 1, 2),
    }


# -- forming the topology ---------------------------------------------------------------------


def test_waiting_until_all_workers_then_ready_with_generation_1() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=3)
    assert state.phase is Phase.WAITING
    for i, node_id in enumerate(["a", "b"]):
        outcome, effects = state.register(reg(state, node_id))
        assert outcome == Accepted(JOB, i + 1, 3, rejoined=False, generation=0)
        assert effects == [ProgressEvent(i + 1, 3)]
        assert state.phase is Phase.WAITING
        assert state.generation == 0
    outcome, effects = state.register(reg(state, "c", host="h1", port=7))
    assert outcome == Accepted(JOB, 3, 3, rejoined=False, generation=1)
    assert state.phase is Phase.READY
    assert state.generation == 1
    assert len(effects) == 2
    assert effects[0] == ProgressEvent(3, 3)
    ready = effects[1]
    assert isinstance(ready, TopologyReadyEvent)
    assert ready.generation == 1
    assert ready.peers == state.peers()
    assert [(p.rank, p.node_id, p.host, p.port, p.role) for p in ready.peers] == [
        (0, "a", "h0", 5000, NodeRole.WORKER),
        (1, "b", "h0", 5000, NodeRole.WORKER),
        (2, "c", "h1", 7, NodeRole.WORKER),
    ]


def test_parameter_servers_have_their_own_rank_space() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=2, server_num=2)
    accept(state, reg(state, "w-b"))
    accept(state, reg(state, "w-a"))
    accept(state, reg(state, "1", role=NodeRole.SERVER, host="ps"))
    assert state.phase is Phase.WAITING  # 3 of 4 nodes
    effects = accept(state, reg(state, "ps-x", role=NodeRole.SERVER, host="ps"))
    assert state.phase is Phase.READY
    assert effects[0] == ProgressEvent(4, 4)
    assert isinstance(effects[1], TopologyReadyEvent)
    assert [(p.role, p.rank, p.node_id) for p in state.peers()] == [
        (NodeRole.WORKER, 0, "w-a"),
        (NodeRole.WORKER, 1, "w-b"),
        (NodeRole.SERVER, 0, "ps-x"),
        (NodeRole.SERVER, 1, "1"),
    ]
    # Servers on host "ps" and workers on "h0" are grouped separately.
    assert [(p.local_rank, p.local_size) for p in state.peers()] == [(0, 2), (1, 2), (0, 2), (1, 2)]


def test_numeric_server_id_is_checked_against_server_num() -> None:
    state = make_state(FakeClock(), worker_num=4, server_num=2)
    refusal = refuse(state, reg(state, "2", role=NodeRole.SERVER), Refusal.INVALID_NODE)
    assert "(2)" in refusal.message
    assert "servers" in refusal.message


def test_node_ids_are_unique_across_roles() -> None:
    state = make_state(FakeClock(), worker_num=1, server_num=1)
    accept(state, reg(state, "0", role=NodeRole.WORKER))
    refusal = refuse(
        state, reg(state, "0", role=NodeRole.SERVER, incarnation=2, host="ps"), Refusal.INVALID_NODE
    )
    assert "already used by a worker" in refusal.message
    accept(state, reg(state, "ps0", role=NodeRole.SERVER, incarnation=3, host="ps"))
    assert state.phase is Phase.READY
    assert [(p.role, p.rank) for p in state.peers()] == [
        (NodeRole.WORKER, 0),
        (NodeRole.SERVER, 0),
    ]


# -- refusals ---------------------------------------------------------------------------------


def test_cluster_full_while_waiting() -> None:
    state = make_state(FakeClock(), worker_num=2, server_num=1)
    accept(state, reg(state, "a"))
    accept(state, reg(state, "b"))
    refusal = refuse(state, reg(state, "c"), Refusal.CLUSTER_FULL)
    assert "'c'" in refusal.message
    assert "MS_WORKER_NUM=2" in refusal.message
    assert refusal.retry_after_s == 0.0


def test_cluster_full_when_ready() -> None:
    state = ready_state(FakeClock(), ["a", "b"])
    refusal = refuse(state, reg(state, "c"), Refusal.CLUSTER_FULL)
    assert "one too many" in refusal.message


@pytest.mark.parametrize(("worker_num", "server_num"), [(3, 0), (5, 0), (4, 1)])
def test_worker_num_mismatch(worker_num: int, server_num: int) -> None:
    state = make_state(FakeClock(), worker_num=4)
    refusal = refuse(
        state,
        reg(state, "a", worker_num=worker_num, server_num=server_num),
        Refusal.WORKER_NUM_MISMATCH,
    )
    assert f"MS_WORKER_NUM={worker_num}" in refusal.message
    assert "MS_WORKER_NUM=4" in refusal.message
    assert state.members == {}


def test_foreign_job_without_recovery_says_to_start_the_node_again() -> None:
    """The scheduler was restarted without recovery: the node's process was in the job that
    ended with it, and joins this one once started again."""
    state = make_state(FakeClock())
    refusal = refuse(state, reg(state, "a", cluster_id="job-0"), Refusal.FOREIGN_JOB)
    assert refusal.message == (
        f"node 'a' belongs to job job-0, but this scheduler runs job {JOB} (recovery is off, so "
        "a restarted scheduler starts a new job): the node's process was in that job, which "
        "ended when its scheduler stopped; start the node again and it joins this job (where it "
        "read that job from its record, worker-a.json in the MS_RECOVERY_PATH of its host, move "
        "that record away first)"
    )


def test_foreign_job() -> None:
    state = make_state(FakeClock(), recovery=True)
    refusal = refuse(state, reg(state, "a", cluster_id="job-0"), Refusal.FOREIGN_JOB)
    assert "job-0" in refusal.message
    assert JOB in refusal.message
    # Where the old job id came from, and the fix that keeps the other job's record intact.
    assert "worker-a.json in the MS_RECOVERY_PATH of its host" in refusal.message
    assert "give each job its own MS_RECOVERY_PATH" in refusal.message
    assert "without its old state" not in refusal.message
    # The node's own job id, or none, is fine.
    accept(state, reg(state, "a", cluster_id=JOB))
    accept(state, reg(state, "b", cluster_id=""))


def test_a_job_started_anew_on_an_empty_prefix_names_a_wrong_prefix_first() -> None:
    """A scheduler that found nothing saved under its etcd prefix and started a job of its own
    is most likely a standby given another prefix than its job's: a node of that job is told
    so first, and the record advice follows."""
    state = make_state(FakeClock(), recovery=True)  # a standby's job recovers
    state.started_anew_under = "etcd://e1:2379/jobs/typo"
    refusal = refuse(state, reg(state, "a", cluster_id="job-0"), Refusal.FOREIGN_JOB)
    assert refusal.message.startswith(
        f"node 'a' belongs to job job-0, but this scheduler runs job {JOB}, which it started "
        "anew under etcd://e1:2379/jobs/typo, where nothing was saved: if job job-0 keeps its "
        "state in etcd under another prefix, this scheduler was started with the wrong "
        "CLUSTER_STATE_URL: stop it and start it with that job's prefix, and keep the node's "
        "record; otherwise: the node's process was in that job"
    ), refusal.message
    assert "give each job its own MS_RECOVERY_PATH" in refusal.message


def test_numeric_id_out_of_range_is_invalid() -> None:
    state = make_state(FakeClock(), worker_num=4)
    refusal = refuse(state, reg(state, "4"), Refusal.INVALID_NODE)
    assert "MS_NODE_ID=4" in refusal.message
    assert "(4)" in refusal.message
    refuse(state, reg(state, "0100"), Refusal.INVALID_NODE)


def test_server_without_servers_is_invalid() -> None:
    state = make_state(FakeClock(), worker_num=4, server_num=0)
    refusal = refuse(state, reg(state, "ps", role=NodeRole.SERVER), Refusal.INVALID_NODE)
    assert "MS_SERVER_NUM=0" in refusal.message


def test_job_over_after_failure() -> None:
    state = ready_state(FakeClock(), ["0", "1"])
    state.disconnect("1", 1)
    assert state.phase is Phase.FAILED
    for node_id, incarnation in [("2", 1), ("1", 2), ("1", 1), ("0", 1)]:
        refusal = refuse(state, reg(state, node_id, incarnation=incarnation), Refusal.JOB_OVER)
        assert "failed" in refusal.message


def test_job_over_after_finish() -> None:
    state = ready_state(FakeClock(), ["0", "1"])
    state.finish("0", 1)
    state.finish("1", 1)
    assert state.phase is Phase.FINISHED
    # Its own refusal, so that a spare or a node waiting out its guard exits 0.
    refusal = refuse(state, reg(state, "0", incarnation=2), Refusal.JOB_FINISHED)
    assert "finished" in refusal.message


def test_finished_node_cannot_come_back_with_a_new_incarnation() -> None:
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"])
    state.finish("0", 1)
    clock.advance(100)
    refusal = refuse(state, reg(state, "0", incarnation=2), Refusal.JOB_OVER)
    assert "already finished" in refusal.message


def test_failed_node_cannot_rejoin_without_recovery() -> None:
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"], heartbeat_enabled=False)
    clock.advance(11)  # past the guard, but nothing noticed the silence
    refusal = refuse(state, reg(state, "0", incarnation=2), Refusal.JOB_OVER)
    assert "recovery is off" in refusal.message


def test_node_alive_guard_with_retry_after() -> None:
    clock = FakeClock()
    state = make_state(clock, node_timeout_s=10.0)
    accept(state, reg(state, "a", incarnation=1))
    clock.advance(4.0)
    refusal = refuse(state, reg(state, "a", incarnation=2), Refusal.NODE_ALIVE)
    assert refusal.retry_after_s == pytest.approx(6.0)
    assert refusal.reason.transient
    assert "MS_NODE_TIMEOUT=10 s" in refusal.message
    assert "retry in 6.0 s" in refusal.message
    # A heartbeat from the live process pushes the guard out again.
    state.heartbeat("a", 1)
    clock.advance(1.0)
    refusal = refuse(state, reg(state, "a", incarnation=2), Refusal.NODE_ALIVE)
    assert refusal.retry_after_s == pytest.approx(9.0)


@pytest.mark.parametrize("worker_num", [4, 8192])
def test_a_node_the_guard_refused_is_awaited_as_long_as_it_may_pause(worker_num: int) -> None:
    """Once the job ends, a node the guard refused lately is waited for until it asks again:
    within the longest pause a worker of a job of this size takes (`backoff.guard_poll_s`:
    1 s up to 750 nodes, longer past them), with the margin."""
    clock = FakeClock()
    state = make_state(clock, worker_num=worker_num, node_timeout_s=10.0)
    accept(state, reg(state, "a", incarnation=1))
    clock.advance(4.0)
    refuse(state, reg(state, "a", incarnation=2), Refusal.NODE_ALIVE)
    window = guard_poll_s(worker_num) + GUARD_POLL_MARGIN_S
    assert state.guard_window_s() == pytest.approx(window)
    clock.advance(window - 0.01)
    assert state.awaited_after_end()
    clock.advance(0.02)
    assert not state.awaited_after_end()


def test_node_alive_guard_applies_when_ready() -> None:
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"])
    clock.advance(2.5)
    refusal = refuse(state, reg(state, "1", incarnation=9), Refusal.NODE_ALIVE)
    assert refusal.retry_after_s == pytest.approx(7.5)


def test_only_node_alive_is_transient() -> None:
    assert [r for r in Refusal if r.transient] == [Refusal.NODE_ALIVE]


def test_same_incarnation_registers_again_idempotently() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=2)
    accept(state, reg(state, "a", port=1))
    clock.advance(3)
    outcome, effects = state.register(reg(state, "a", port=1))
    assert outcome == Accepted(JOB, 1, 2, rejoined=False, generation=0)
    assert effects == []
    assert len(state.members) == 1
    member = state.member("a", 1)
    assert (member.host, member.port, member.last_seen) == ("h0", 1, clock.now)
    # Also once the job is formed.
    accept(state, reg(state, "b"))
    outcome, effects = state.register(reg(state, "b"))
    assert outcome == Accepted(JOB, 2, 2, rejoined=False, generation=1)
    assert effects == []
    assert state.generation == 1


# -- losing nodes -----------------------------------------------------------------------------


def test_disconnect_when_ready_fails_the_job_naming_the_rank() -> None:
    state = ready_state(FakeClock(), ["0", "1", "2"])
    effects = state.disconnect("2", 1)
    assert len(effects) == 2
    failed, shutdown = effects
    assert isinstance(failed, NodeFailedEvent)
    assert (failed.rank, failed.node_id, failed.generation) == (2, "2", 1)
    assert "connection" in failed.reason
    assert isinstance(shutdown, ShutdownEvent)
    assert shutdown.ok is False
    assert "rank 2" in shutdown.reason
    assert state.phase is Phase.FAILED
    assert state.member("2", 1).state is NodeState.FAILED
    # A second disconnect, or another node's, adds nothing.
    assert state.disconnect("2", 1) == []
    assert state.disconnect("0", 1) == []


def test_a_node_failed_before_its_stream_opened_is_refused_the_stream() -> None:
    """Found by the simulation: a reconnection accepted while its answer waits for its save,
    then the node's older stream ends (so it fails, and its failure is told to the streams
    open then), then the new stream would open on a failed member, hearing nothing of it."""
    state = ready_state(FakeClock(), ["0", "1", "2"], recovery=True)
    accept(state, reg(state, "2", port=6002))  # the same process again: a reconnection
    assert any(isinstance(e, NodeFailedEvent) for e in state.disconnect("2", 1))
    with pytest.raises(EvictedError, match="registers again"):
        state.connect("2", 1)
    assert state.member("2", 1).state is NodeState.FAILED


def test_disconnect_while_waiting_forgets_the_node() -> None:
    state = make_state(FakeClock(), worker_num=3)
    accept(state, reg(state, "a"))
    accept(state, reg(state, "b"))
    effects = state.disconnect("a", 1)
    assert len(effects) == 2
    assert isinstance(effects[0], Evict)
    assert (effects[0].node_id, effects[0].incarnation) == ("a", 1)
    assert effects[1] == ProgressEvent(1, 3)
    assert set(state.members) == {"b"}
    assert state.phase is Phase.WAITING
    # A new process takes its place at once: no guard for a forgotten node.
    outcome, effects = state.register(reg(state, "a", incarnation=2))
    assert isinstance(outcome, Accepted)
    assert effects == [ProgressEvent(2, 3)]


def test_heartbeat_silence_fails_the_node_when_ready() -> None:
    clock = FakeClock()
    state = ready_state(clock, ["0", "1", "2"], node_timeout_s=10.0)
    clock.advance(6)
    state.heartbeat("0", 1)
    state.heartbeat("2", 1)
    assert state.tick() == []
    clock.advance(4.5)  # rank 1 silent for 10.5 s, the others for 4.5 s
    effects = state.tick()
    assert len(effects) == 2
    failed, shutdown = effects
    assert isinstance(failed, NodeFailedEvent)
    assert failed.rank == 1
    # A silent member may be a healthy one whose Python thread could not beat: it says so.
    assert failed.reason == (
        "no heartbeat for 10.5 s (hung, cut off, or holding Python's GIL in a long call: raise "
        "MS_NODE_TIMEOUT)"
    )
    assert isinstance(shutdown, ShutdownEvent)
    assert shutdown.ok is False
    assert "rank 1" in shutdown.reason
    assert state.phase is Phase.FAILED


def test_heartbeats_keep_nodes_alive() -> None:
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"], node_timeout_s=10.0)
    for _ in range(50):
        clock.advance(9.0)
        state.heartbeat("0", 1)
        state.heartbeat("1", 1)
        assert state.tick() == []
    assert state.phase is Phase.READY


def test_no_failure_detection_without_heartbeat() -> None:
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"], node_timeout_s=10.0, heartbeat_enabled=False)
    clock.advance(10_000)
    assert state.tick() == []
    assert state.phase is Phase.READY


def test_heartbeat_silence_while_waiting_forgets_the_node() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=3, node_timeout_s=10.0)
    accept(state, reg(state, "a"))
    clock.advance(5)
    accept(state, reg(state, "b"))
    clock.advance(6)
    assert state.tick() == []  # a registration 6 s ago: a's beats may wait behind it
    state.heartbeat("b", 1)
    clock.advance(4.5)  # 10.5 s since the last registration, and a was not heard since
    effects = state.tick()
    assert len(effects) == 2
    assert isinstance(effects[0], Evict)
    assert effects[0].node_id == "a"
    assert effects[1] == ProgressEvent(1, 3)
    assert set(state.members) == {"b"}
    assert state.phase is Phase.WAITING


def test_a_burst_of_registrations_holds_back_everyones_silence() -> None:
    """A node's heartbeats wait in gRPC's queue behind the registrations that came before
    them: while registrations are accepted, nobody's silence counts; after the burst, a silent
    node is found MS_NODE_TIMEOUT later."""
    clock = FakeClock()
    state = make_state(clock, worker_num=4, node_timeout_s=10.0)
    accept(state, reg(state, "a"))
    for name in ("b", "c"):
        clock.advance(8.0)
        accept(state, reg(state, name))
    clock.advance(9.0)  # "a" unheard for 25 s, but the last registration was 9 s ago
    assert state.tick() == []
    state.heartbeat("c", 1)
    clock.advance(1.5)
    forgotten = [e.node_id for e in state.tick() if isinstance(e, Evict)]
    assert sorted(forgotten) == ["a", "b"]
    assert set(state.members) == {"c"}


def _first_failure(
    state: SchedulerState, clock: FakeClock, beating: list[str], register: Any
) -> tuple[float, list[NodeFailedEvent]]:
    """Seconds pass; `beating` beat every second, `register(t)` registers something every 5 s;
    the first failures found, and when (at most 200 s)."""
    started = clock()
    for t in range(1, 201):
        clock.advance(1.0)
        for node_id in beating:
            state.heartbeat(node_id, 1)
        if t % 5 == 0:
            accept(state, register(t))
        failed = [e for e in state.tick() if isinstance(e, NodeFailedEvent)]
        if failed:
            return clock() - started, failed
    return clock() - started, []


@pytest.mark.parametrize("spares", ["the same spare again", "new spares"])
def test_registrations_once_the_job_formed_do_not_hide_a_hung_node(spares: str) -> None:
    """Only a burst of registrations holds back silence: one spare asking again every 5 s, or
    new spares joining, held back every node's, and a hung worker was never found."""
    clock = FakeClock()
    state = ready_state(clock, ["0", "1", "2"], recovery=True)
    spare = reg(state, "x", spare=True, port=9999)
    accept(state, spare)

    def register(t: int) -> Registration:
        return spare if spares == "the same spare again" else reg(state, f"x{t}", spare=True)

    took, failed = _first_failure(state, clock, ["0", "1", "x"], register)
    assert [e.node_id for e in failed] == ["2"]
    assert "no heartbeat" in failed[0].reason
    assert took <= state.settings.silence_limit_s + 1


def test_a_restored_jobs_burst_ends_by_ms_topo_timeout() -> None:
    """After a restore, registrations hold silence back while the nodes come back, for at
    most MS_TOPO_TIMEOUT: a spare asking again every 5 s cannot hide a node that never came
    back."""
    clock = FakeClock()
    before = recovering(clock)
    accept(before, reg(before, "x", spare=True, port=9999))
    restored = restore(before.snapshot(), clock)
    for node_id in ("0", "1"):
        accept(restored, reg(restored, node_id, port=6000 + int(node_id)))
        restored.connect(node_id, 1)
    spare = reg(restored, "x", spare=True, port=9999)
    took, failed = _first_failure(restored, clock, ["0", "1", "x"], lambda t: spare)
    assert [e.node_id for e in failed] == ["2"]
    assert "did not reconnect" in failed[0].reason
    settings = restored.settings
    assert settings.topo_timeout_s < took <= settings.topo_timeout_s + settings.silence_limit_s + 1


@pytest.mark.parametrize("gone", ["failed", "finished"])
def test_a_restored_node_failed_or_finished_ends_the_burst(gone: str) -> None:
    """A restored node found failed (it did not reconnect) or that finished before it came back
    is awaited no more: the burst ends with the others back, and a spare asking again every 5 s
    cannot hold a hung node's silence back until MS_TOPO_TIMEOUT."""
    clock = FakeClock()
    before = recovering(clock, n=4)
    accept(before, reg(before, "x", spare=True, port=9999))
    restored = restore(before.snapshot(), clock, worker_num=4)
    for node_id in ("0", "1", "2"):
        accept(restored, reg(restored, node_id, port=6000 + int(node_id)))
        restored.connect(node_id, 1)
    if gone == "failed":
        clock.advance(restored.settings.silence_limit_s + 0.5)
        for node_id in ("0", "1", "2"):
            restored.heartbeat(node_id, 1)
        failed = [e for e in restored.tick() if isinstance(e, NodeFailedEvent)]
        assert [(e.node_id, "did not reconnect" in e.reason) for e in failed] == [("3", True)]
    else:
        accept(restored, reg(restored, "3", port=6003))
        restored.finish("3", 1)
    assert restored.awaiting == set()
    spare = reg(restored, "x", spare=True, port=9999)
    took, hung = _first_failure(restored, clock, ["0", "2"], lambda t: spare)  # "1" hangs
    assert [e.node_id for e in hung] == ["1"]
    assert took <= restored.settings.silence_limit_s + 1, hung[0].reason


def test_a_node_that_joins_after_a_tick_found_nobody_is_still_watched() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=2, node_timeout_s=10.0)
    assert state.tick() == []  # nobody to watch: the next look is "never"
    accept(state, reg(state, "a"))
    clock.advance(10.5)
    effects = state.tick()
    assert [type(e) for e in effects] == [Evict, ProgressEvent]


def test_ticks_between_silence_limits_look_at_no_member() -> None:
    """A tick costs O(members) only when some member's silence can have reached its limit."""
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"], node_timeout_s=10.0)
    state.tick()
    for member in state.members.values():
        member.last_seen = -1e9  # would be long silent, were they looked at
    clock.advance(9.0)
    assert state.tick() == []
    clock.advance(1.5)  # past the first limit: now they are looked at
    assert any(isinstance(e, NodeFailedEvent) for e in state.tick())


def test_the_schedulers_own_stall_is_not_the_nodes_silence() -> None:
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"], node_timeout_s=10.0)
    clock.advance(6.0)
    state.heartbeat("0", 1)
    clock.advance(8.0)  # stopped for 8 s: rank 1 last heard 14 s ago, rank 0 8 s ago
    state.discount_stall(8.0)
    assert state.tick() == []
    clock.advance(4.5)  # 10.5 s of silence that the scheduler heard (6 + 4.5): rank 1 fails
    (failed, _shutdown) = state.tick()
    assert isinstance(failed, NodeFailedEvent)
    assert failed.rank == 1


def test_connect_counts_as_seen() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=2, node_timeout_s=10.0)
    accept(state, reg(state, "a"))
    clock.advance(8)
    assert state.connect("a", 1) == []
    assert state.member("a", 1).connected is True
    clock.advance(8)
    assert state.tick() == []


# -- topology timeout -------------------------------------------------------------------------


def test_topology_timeout_names_the_missing_rank() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=4, topo_timeout_s=5.0, node_timeout_s=30.0)
    for node_id in ["0", "2", "1"]:
        accept(state, reg(state, node_id))
    clock.advance(5.0)
    assert state.tick() == []  # not yet past the timeout
    clock.advance(0.1)
    effects = state.tick()
    assert effects == [
        ShutdownEvent(
            ok=False,
            reason="3 of 4 workers registered after 5 s (MS_TOPO_TIMEOUT); missing: rank 3",
        )
    ]
    assert state.phase is Phase.FAILED
    assert state.catch_up() == effects


def test_topology_timeout_names_missing_rank_ranges() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=8, topo_timeout_s=5.0, node_timeout_s=30.0)
    for node_id in ["0", "4", "5"]:
        accept(state, reg(state, node_id))
    clock.advance(5.2)
    (shutdown,) = state.tick()
    assert isinstance(shutdown, ShutdownEvent)
    assert shutdown.reason.endswith("; missing: ranks 1-3, 6-7")
    assert shutdown.reason.startswith("3 of 8 workers registered after 5 s")


def test_topology_timeout_lists_registered_non_numeric_ids() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=4, topo_timeout_s=5.0, node_timeout_s=30.0)
    accept(state, reg(state, "worker-b"))
    accept(state, reg(state, "worker-a"))
    clock.advance(5.4)
    assert state.tick() == [
        ShutdownEvent(
            ok=False,
            reason="2 of 4 workers registered after 5 s (MS_TOPO_TIMEOUT); "
            "registered node ids: worker-a, worker-b",
        )
    ]


def test_a_topology_timeout_of_thousands_names_the_first_and_counts_the_rest() -> None:
    """A job of thousands that did not form: its reason (told to every worker, journaled, sent
    to each reader of the events) names the first 32 ids or spans of missing ranks, not 8 MiB."""
    clock = FakeClock()
    state = make_state(clock, worker_num=4000, topo_timeout_s=5.0, node_timeout_s=30.0)
    for node_id in [f"w{i:04d}" for i in range(100)]:
        accept(state, reg(state, node_id))
    clock.advance(5.4)
    (shutdown,) = state.tick()
    assert isinstance(shutdown, ShutdownEvent)
    names = ", ".join(f"w{i:04d}" for i in range(32))
    assert shutdown.reason.endswith(f"registered node ids: {names} and 68 more")
    state = make_state(clock, worker_num=4000, topo_timeout_s=5.0, node_timeout_s=30.0)
    for rank in range(0, 4000, 2):  # every other rank: 2,000 spans missing
        accept(state, reg(state, str(rank)))
    clock.advance(5.4)
    (shutdown,) = state.tick()
    assert isinstance(shutdown, ShutdownEvent)
    spans = ", ".join(str(rank) for rank in range(1, 64, 2))
    assert shutdown.reason.endswith(f"missing: ranks {spans} and 1968 more")


def test_topology_timeout_with_nobody() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=2, server_num=1, topo_timeout_s=5.0)
    clock.advance(5.4)
    (shutdown,) = state.tick()
    assert isinstance(shutdown, ShutdownEvent)
    assert shutdown.reason == (
        "0 of 2 workers and 0 of 1 servers registered after 5 s (MS_TOPO_TIMEOUT); "
        "missing: ranks 0-1"
    )


def test_topology_timeout_with_all_numeric_workers_but_a_server_missing() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=2, server_num=1, topo_timeout_s=5.0)
    accept(state, reg(state, "0"))
    accept(state, reg(state, "1"))
    clock.advance(5.4)
    effects = state.tick()
    assert len(effects) == 1
    assert isinstance(effects[0], ShutdownEvent)
    assert effects[0].ok is False
    assert effects[0].reason.startswith(
        "2 of 2 workers and 0 of 1 servers registered after 5 s (MS_TOPO_TIMEOUT)"
    )
    assert state.phase is Phase.FAILED


def test_no_topology_timeout_once_ready() -> None:
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"], topo_timeout_s=5.0, heartbeat_enabled=False)
    clock.advance(100)
    assert state.tick() == []
    assert state.phase is Phase.READY


# -- finishing --------------------------------------------------------------------------------


def test_finish_of_all_ends_the_job_ok() -> None:
    state = ready_state(FakeClock(), ["0", "1", "2"])
    assert state.finish("1", 1) == []
    assert state.finish("0", 1) == []
    assert state.phase is Phase.READY
    effects = state.finish("2", 1)
    assert effects == [ShutdownEvent(ok=True, reason="all 3 nodes finished")]
    assert state.phase is Phase.FINISHED
    assert state.catch_up() == effects


def test_finish_is_idempotent() -> None:
    state = ready_state(FakeClock(), ["0", "1"])
    assert state.finish("0", 1) == []
    assert state.finish("0", 1) == []
    assert state.phase is Phase.READY


def test_finish_while_waiting_frees_the_slot() -> None:
    state = make_state(FakeClock(), worker_num=2)
    accept(state, reg(state, "a"))
    assert state.finish("a", 1) == [ProgressEvent(0, 2)]
    assert state.members == {}
    accept(state, reg(state, "b"))
    accept(state, reg(state, "c"))
    assert state.phase is Phase.READY
    assert ranks(state) == {"b": 0, "c": 1}


def test_disconnect_after_finish_is_not_a_failure() -> None:
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"], node_timeout_s=10.0)
    state.finish("0", 1)
    assert state.disconnect("0", 1) == []
    clock.advance(60)
    state.heartbeat("1", 1)
    assert state.tick() == []
    assert state.phase is Phase.READY
    assert state.finish("1", 1) == [ShutdownEvent(ok=True, reason="all 2 nodes finished")]


def test_finish_of_unknown_node_raises() -> None:
    state = ready_state(FakeClock(), ["0", "1"])
    with pytest.raises(UnknownNodeError):
        state.finish("0", 2)


# -- incarnations -----------------------------------------------------------------------------


def test_new_incarnation_replaces_a_silent_node_while_waiting() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=2, node_timeout_s=10.0, heartbeat_enabled=False)
    accept(state, reg(state, "a", incarnation=1, port=1))
    clock.advance(10.5)
    outcome, effects = state.register(reg(state, "a", incarnation=2, port=2))
    assert isinstance(outcome, Accepted)
    assert effects == [Evict("a", 1, "replaced by a new process")]
    member = state.member("a", 2)
    assert (member.port, member.restarts) == (2, 1)
    # The old incarnation's stream closing late is ignored.
    assert state.disconnect("a", 1) == []
    assert state.member("a", 2) is member
    with pytest.raises(UnknownNodeError):
        state.member("a", 1)
    with pytest.raises(UnknownNodeError):
        state.heartbeat("a", 1)


def test_old_incarnation_disconnect_ignored_when_ready() -> None:
    state = ready_state(FakeClock(), ["0", "1"])
    assert state.disconnect("1", 0) == []
    assert state.disconnect("nobody", 1) == []
    assert state.phase is Phase.READY


def test_member_lookup() -> None:
    state = make_state(FakeClock(), worker_num=8)
    accept(state, reg(state, "7", incarnation=42))
    assert state.member("007", 42).node_id == "7"
    with pytest.raises(UnknownNodeError, match="register first"):
        state.member("7", 41)
    with pytest.raises(UnknownNodeError, match="'ghost'"):
        state.member("ghost", 42)
    with pytest.raises(UnknownNodeError):
        state.connect("ghost", 1)


def test_member_lookup_of_unicode_digit_id_raises_unknown_node() -> None:
    state = make_state(FakeClock(), worker_num=2)
    with pytest.raises(UnknownNodeError):
        state.member("²", 1)


def test_register_of_unicode_digit_id_answers() -> None:
    state = make_state(FakeClock(), worker_num=2)
    outcome, _ = state.register(reg(state, "²"))
    assert isinstance(outcome, Accepted | Refused)


# -- catch_up ----------------------------------------------------------------------------------


def test_catch_up_per_phase() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=2)
    assert state.catch_up() == []
    accept(state, reg(state, "a"))
    assert state.catch_up() == []
    assert state.connect("a", 1) == []
    accept(state, reg(state, "b"))
    assert state.catch_up() == [TopologyReadyEvent(1, state.peers())]
    assert len(state.peers()) == 2
    failed_state = ready_state(FakeClock(), ["0", "1"])
    failed_state.abort("operator pressed Ctrl-C")
    assert failed_state.catch_up() == [ShutdownEvent(ok=False, reason="operator pressed Ctrl-C")]
    state.finish("a", 1)
    state.finish("b", 1)
    assert state.catch_up() == [ShutdownEvent(ok=True, reason="all 2 nodes finished")]


def test_abort_once() -> None:
    state = make_state(FakeClock(), worker_num=2)
    assert state.abort("stop") == [ShutdownEvent(ok=False, reason="stop")]
    assert state.phase is Phase.FAILED
    assert state.abort("again") == []
    assert state.detail == "stop"


# -- properties -------------------------------------------------------------------------------

WORKER_IDS = ["0", "1", "2", "3", "03", "a", "b", "c", "d", "e"]
SERVER_IDS = ["ps-a", "ps-b", "ps-c"]
HOSTS = ["h0", "h1", "h2"]
FORWARD = {
    Phase.WAITING: {Phase.WAITING, Phase.READY, Phase.FAILED},
    Phase.READY: {Phase.READY, Phase.FINISHED, Phase.FAILED},
    Phase.FINISHED: {Phase.FINISHED},
    Phase.FAILED: {Phase.FAILED},
}
NODE_TIMEOUT_S = 10.0

node_ids = st.sampled_from(WORKER_IDS + SERVER_IDS)
incarnations = st.integers(min_value=1, max_value=3)  # restarts in the machine add 10


def _everything(state: SchedulerState) -> object:
    """All a call could change: the saved state and every member's fields in memory."""
    return (
        json.dumps(state.snapshot(), sort_keys=True),
        [dataclasses.astuple(m) for m in state.members.values()],
        state.phase,
        state.generation,
        state.detail,
        sorted(state.awaiting),
    )


FORGERIES = ["none", "another node's", "an older incarnation's", "garbage"]


def forged_digest(forgery: str, node_id: str, incarnation: int) -> bytes:
    """A credential hash that is not (node_id, incarnation)'s, as a forger would present."""
    if forgery == "none":
        return b""
    if forgery == "another node's":
        return digest(node_id + "x", incarnation)
    if forgery == "an older incarnation's":
        return digest(node_id, incarnation - 1)
    return b"\x00" * 32


class SchedulerMachine(RuleBasedStateMachine):
    """Random registrations, disconnects, heartbeats, finishes and passing time; and forged
    calls and registrations, which must be refused and change nothing."""

    @initialize(
        worker_num=st.integers(min_value=1, max_value=4),
        server_num=st.integers(min_value=0, max_value=2),
        heartbeat_enabled=st.booleans(),
        topo_timeout_s=st.sampled_from([15.0, 60.0, 1e9]),
        recovery=st.booleans(),
        job_secret=st.sampled_from([None, b"the job's secret"]),
    )
    def setup(
        self,
        worker_num: int,
        server_num: int,
        heartbeat_enabled: bool,
        topo_timeout_s: float,
        recovery: bool,
        job_secret: bytes | None,
    ) -> None:
        self.clock = FakeClock()
        self.state = make_state(
            self.clock,
            worker_num=worker_num,
            server_num=server_num,
            node_timeout_s=NODE_TIMEOUT_S,
            topo_timeout_s=topo_timeout_s,
            heartbeat_enabled=heartbeat_enabled,
            recovery=recovery,
            job_secret=job_secret,
        )
        # Registrations sent so far (the latest few): a forger may replay them.
        self.sent: list[Registration] = []
        self.generation = 0
        self.saved = _durable(self.state)
        self.phase = Phase.WAITING
        self.assigned: dict[str, int] = {}
        # One process keeps its host: the same (node id, incarnation) always registers from the
        # host it first used (see test_same_incarnation_from_another_host_keeps_peers_consistent).
        self.hosts: dict[tuple[str, int], str] = {}
        # Each member's incarnation and state after the last input: what the next may change.
        self.known = _known(self.state)
        # The last registration of a burst (the job forming, or a restored job's nodes coming
        # back within MS_TOPO_TIMEOUT), from which silence counts at the earliest; and when the
        # scheduler was last restored.
        self.burst_at = float("-inf")
        self.restored_at = float("-inf")
        self.report_numbers = itertools.count(1)

    def _in_burst(self) -> bool:
        """Registrations come as a burst while the job forms, and after a restart while an
        alive member is not back yet (one failed or finished meanwhile comes back, if ever, as
        one node) within MS_TOPO_TIMEOUT."""
        state, now = self.state, self.clock.now
        back_soon = any(
            m.state is NodeState.ALIVE and m.node_id in state.awaiting
            for m in state.members.values()
        )
        restoring = back_soon and now - self.restored_at <= state.settings.topo_timeout_s
        return state.phase is Phase.WAITING or restoring

    def _after(self, effects: list[Effect], *, leaving: bool = False) -> None:
        """`leaving`: the input was a node's own Finish (while forming, it frees its slot)."""
        self._all_told(effects, leaving=leaving)
        new = self.state.phase
        assert new in FORWARD[self.phase], f"{self.phase} -> {new}"
        shutdowns = [e for e in effects if isinstance(e, ShutdownEvent)]
        readies = [e for e in effects if isinstance(e, TopologyReadyEvent)]
        if new is not self.phase and new in (Phase.FINISHED, Phase.FAILED):
            assert len(shutdowns) == 1
            assert shutdowns[0].ok is (new is Phase.FINISHED)
            assert shutdowns[0].reason
        else:
            assert shutdowns == []
        if new is Phase.READY and self.phase is Phase.WAITING:
            assert len(readies) == 1
            assert readies[0].generation == 1
            assert len(readies[0].peers) == self.state.expected
        elif self.state.recovery and readies:
            # A rejoin: exactly one new generation, with the whole table.
            assert len(readies) == 1
            assert readies[0].generation == self.generation + 1
            assert len(readies[0].peers) == self.state.expected
            event("rejoined")
        else:
            assert readies == []
        assert self.state.generation == self.generation + len(readies)
        self.generation = self.state.generation
        # Whatever a restarted scheduler would need to know differently bumps the revision,
        # so that the scheduler saves it before telling anyone.
        durable = _durable(self.state)
        if durable[0] != self.saved[0]:
            assert durable[1] != self.saved[1], (self.saved[0], durable[0])
        self.saved = durable
        self.phase = new
        event(f"reached {new.value}")

    def _all_told(self, effects: list[Effect], *, leaving: bool) -> None:
        """No effect whose state change was applied is lost: a member that failed is told to
        the others, a process that is no longer a member has its stream ended."""
        failed = {e.node_id for e in effects if isinstance(e, NodeFailedEvent)}
        evicted = {(e.node_id, e.incarnation) for e in effects if isinstance(e, Evict)}
        for node_id, (incarnation, was) in self.known.items():
            member = self.state.members.get(node_id)
            if member is None or member.incarnation != incarnation:
                assert leaving or (node_id, incarnation) in evicted, (node_id, effects)
            elif was is NodeState.ALIVE and member.state is NodeState.FAILED:
                assert node_id in failed, (node_id, effects)
                event("a failure told")
        self.known = _known(self.state)

    @rule(
        node_id=node_ids,
        host=st.sampled_from(HOSTS),
        incarnation=incarnations,
        matching=st.integers(min_value=0, max_value=9),
        cluster_id=st.sampled_from(["", "", "", JOB, "other-job"]),
        stated=st.booleans(),
    )
    def register(
        self,
        node_id: str,
        host: str,
        incarnation: int,
        matching: int,
        cluster_id: str,
        stated: bool = True,
    ) -> None:
        """`stated`: the node names its release beside its protocol revision (this one's), or
        the revision alone: taken alike (a node that names no revision is of revision 1, which
        `other_revision_registers` covers)."""
        role = NodeRole.SERVER if node_id in SERVER_IDS else NodeRole.WORKER
        host = self.hosts.setdefault((canonical_node_id(node_id), incarnation), host)
        worker_num = self.state.settings.worker_num + (1 if matching == 0 else 0)
        registration = reg(
            self.state,
            node_id,
            host=host,
            role=role,
            incarnation=incarnation,
            worker_num=worker_num,
            cluster_id=cluster_id,
            protocol_revision=PROTOCOL_REVISION,
            cluster_version=VERSION if stated else "",
        )
        before = len(self.state.members)
        self.sent = [*self.sent[-4:], registration]
        burst = self._in_burst()
        outcome, effects = self.state.register(registration)
        if burst and isinstance(outcome, Accepted):
            self.burst_at = self.clock.now
        if isinstance(outcome, Refused):
            assert isinstance(outcome.reason, Refusal)
            assert outcome.message.strip()
            if outcome.reason is Refusal.NODE_ALIVE:
                assert outcome.retry_after_s > 0
                assert outcome.retry_after_s <= NODE_TIMEOUT_S
            else:
                assert outcome.retry_after_s == 0
            assert effects == []
            assert len(self.state.members) == before
        else:
            assert isinstance(outcome, Accepted)
            assert outcome.cluster_id == JOB
            assert outcome.expected == self.state.expected
            assert outcome.registered == len(self.state.members)
            member = self.state.member(node_id, incarnation)
            assert member.role is role
            assert member.host == host
        self._after(effects)

    @rule(index=st.integers(min_value=0, max_value=20), host=st.sampled_from(HOSTS))
    def register_fresh(self, index: int, host: str) -> None:
        """A new, well-configured node: makes forming the topology likely."""
        taken = {canonical_node_id(i) for i in self.state.members}
        fresh = [i for i in WORKER_IDS + SERVER_IDS if canonical_node_id(i) not in taken]
        if fresh:
            node_id = fresh[index % len(fresh)]
            self.register(node_id, host, incarnation=1, matching=1, cluster_id="", stated=True)

    @rule(hosts=st.lists(st.sampled_from(HOSTS), min_size=6, max_size=6))
    def fill(self, hosts: list[str]) -> None:
        """Fresh nodes that fit until the job is full (or nobody can join any more)."""
        for host in hosts:
            node_id = self._fitting()
            if self.state.phase is not Phase.WAITING or node_id is None:
                return
            self.register(node_id, host, incarnation=1, matching=1, cluster_id="")

    def _fitting(self) -> str | None:
        """A node id not taken, of a role the job still lacks, that is a valid rank."""
        state = self.state
        taken = {canonical_node_id(i) for i in state.members}
        workers = sum(1 for m in state.members.values() if m.role is NodeRole.WORKER)
        if workers < state.settings.worker_num:
            fitting = [
                i for i in WORKER_IDS if not i.isdigit() or int(i) < state.settings.worker_num
            ]
        else:
            fitting = SERVER_IDS
        fresh = [i for i in fitting if canonical_node_id(i) not in taken]
        return fresh[0] if fresh else None

    @rule()
    def finish_all(self) -> None:
        for member in sorted(self.state.members.values(), key=lambda m: m.node_id):
            self._after(self.state.finish(member.node_id, member.incarnation), leaving=True)

    def _pick(self, index: int) -> tuple[str, int] | None:
        members = sorted(self.state.members.values(), key=lambda m: m.node_id)
        if not members:
            return None
        member = members[index % len(members)]
        return member.node_id, member.incarnation

    @rule(index=st.integers(min_value=0, max_value=20))
    def finish_member(self, index: int) -> None:
        picked = self._pick(index)
        if picked is not None:
            self._after(self.state.finish(*picked), leaving=True)

    @rule(index=st.integers(min_value=0, max_value=20))
    def disconnect_member(self, index: int) -> None:
        picked = self._pick(index)
        if picked is not None:
            self._after(self.state.disconnect(*picked))

    @rule()
    def disconnect_newest(self) -> None:
        """The member that registered last loses its connection (the others, registered
        before it, come first in every pass over the members)."""
        if self.state.members:
            member = list(self.state.members.values())[-1]
            self._after(self.state.disconnect(member.node_id, member.incarnation))

    @rule(node_id=node_ids, incarnation=incarnations)
    def connect(self, node_id: str, incarnation: int) -> None:
        try:
            welcome = self.state.connect(node_id, incarnation)
        except UnknownNodeError:
            return
        except EvictedError:  # a failed member opens no stream
            assert self.state.member(node_id, incarnation).state is NodeState.FAILED
            return
        assert welcome == self.state.catch_up()

    @rule(node_id=node_ids, incarnation=incarnations)
    def disconnect(self, node_id: str, incarnation: int) -> None:
        self._after(self.state.disconnect(node_id, incarnation))

    @rule(node_id=node_ids, incarnation=incarnations)
    def heartbeat(self, node_id: str, incarnation: int) -> None:
        try:
            self.state.heartbeat(node_id, incarnation)
        except UnknownNodeError:
            return
        assert self.state.member(node_id, incarnation).last_seen == self.clock.now

    @rule()
    def heartbeat_all(self) -> None:
        for member in list(self.state.members.values()):
            self.state.heartbeat(member.node_id, member.incarnation)

    @rule(node_id=node_ids, incarnation=incarnations)
    def finish(self, node_id: str, incarnation: int) -> None:
        try:
            effects = self.state.finish(node_id, incarnation)
        except UnknownNodeError:
            return
        self._after(effects, leaving=True)

    @rule(seconds=st.sampled_from([0.5, 3.0, 9.0, 11.0, 40.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def tick(self) -> None:
        self._after(self.state.tick())
        # However seldom a tick looks at the members, none is left past its limit (while the
        # job runs: a tick that ends it stops there), counted from its last sign of life or the
        # last registration of a burst: no other registration holds silence back.
        now = self.clock.now
        # ... and the machine's floor is no later than that last registration of a burst.
        assert self.state.liveness.last_accepted <= self.burst_at
        running = self.state.phase in (Phase.WAITING, Phase.READY)
        for m in self.state.members.values() if running else ():
            watched = self.state.settings.heartbeat_enabled or m.node_id in self.state.awaiting
            if m.state is NodeState.ALIVE and watched:
                silent = now - max(m.last_seen, self.burst_at)
                assert silent <= self.state.settings.node_timeout_s, (m, self.burst_at)
            if m.state is NodeState.FAILED and self.state.phase is Phase.READY:
                # Failed in this very tick, it may be past its rejoin window already: the
                # next tick must look at it by then.
                limit = self.state.settings.node_timeout_s + self.state.settings.topo_timeout_s
                assert self.state.liveness.next_scan <= m.last_seen + limit, m

    @rule(seconds=st.sampled_from([2.0, 12.0]))
    def stall(self, seconds: float) -> None:
        """The scheduler's process did not run for a while."""
        self.clock.advance(seconds)
        self.state.discount_stall(seconds)

    @rule(seconds=st.sampled_from([11.0, 40.0]))
    def time_passes(self, seconds: float) -> None:
        """Time passes for every node at once, as the scheduler's monitor sees it: several may
        fail, or end the job, in one tick."""
        self.advance(seconds)
        self.tick()

    @rule(index=st.integers(min_value=0, max_value=20), wait=st.sampled_from([3.0, 11.0]))
    def kill_and_restart(self, index: int, wait: float) -> None:
        """A node's process dies and is started again with the same id (a new incarnation)."""
        picked = self._pick(index)
        if picked is None:
            return
        node_id, incarnation = picked
        self._after(self.state.disconnect(node_id, incarnation))
        self.clock.advance(wait)
        host = self.state.members[node_id].host if node_id in self.state.members else "h0"
        self.hosts[(node_id, incarnation + 10)] = host
        self.register(node_id, host, incarnation=incarnation + 10, matching=1, cluster_id=JOB)

    @rule()
    def restart_scheduler(self) -> None:
        """Save, lose everything in memory, restore: the job goes on with what was saved."""
        state = self.state
        if not state.recovery or state.phase in (Phase.FINISHED, Phase.FAILED):
            return
        saved = json.loads(json.dumps(state.snapshot()))
        restored = SchedulerState.restore(
            saved, state.settings, self.clock, new_cluster_id="unused"
        )
        assert restored.cluster_id == JOB
        assert restored.generation == state.generation
        assert restored.phase is state.phase
        if state.phase is Phase.READY:
            assert restored.peers() == state.peers()
            assert restored.catch_up() == state.catch_up()
            assert {k: (m.state, m.incarnation) for k, m in restored.members.items()} == {
                k: (m.state, m.incarnation) for k, m in state.members.items()
            }
        else:
            assert restored.members == {}
        self.state = restored
        self.restored_at = self.clock.now
        self.saved = _durable(restored)
        self.known = _known(restored)
        # The nonces seen are not saved: a replay is refused only within one scheduler's life.
        self.sent = []
        event(f"scheduler restarted while {restored.phase.value}")

    # -- forgeries: refused, and nothing changes ------------------------------------------------

    def _forged_target(self, index: int) -> tuple[str, int]:
        picked = self._pick(index)
        return picked if picked is not None else (WORKER_IDS[index % len(WORKER_IDS)], 1)

    @rule(
        index=st.integers(min_value=0, max_value=20),
        forgery=st.sampled_from(FORGERIES),
        call=st.sampled_from(["hello", "heartbeat", "finish", "kv", "report", "exchange"]),
        stale=st.booleans(),
    )
    def forged_call(self, index: int, forgery: str, call: str, stale: bool) -> None:
        """A call that speaks for a member (or a stale incarnation of it) without its
        credential."""
        node_id, incarnation = self._forged_target(index)
        if stale:  # the incarnation Status showed before the node was restarted
            incarnation += 7
        presented = auth.Presented(forged_digest(forgery, node_id, incarnation))
        before = _everything(self.state)
        if call == "exchange":
            verdict: object = self.state.admission.admit_exchange(
                node_id, presented, generation=self.state.generation, op="allgather", root=0
            )
        elif call == "report":
            verdict = self.state.admission.admit_report(node_id, incarnation, presented, 3)
        else:
            verdict = self.state.admission.admit(
                node_id, None if call == "kv" else incarnation, presented
            )
        assert isinstance(verdict, Denied), verdict
        assert verdict.kind in (Denial.UNAUTHENTICATED, Denial.NOT_A_MEMBER)
        assert verdict.message.strip()
        assert _everything(self.state) == before
        event(f"forged {call} refused: {verdict.kind.value}")

    @rule(
        index=st.integers(min_value=0, max_value=20),
        forgery=st.sampled_from(["other host", "other credential", "both"]),
    )
    def forged_register_of_a_member(self, index: int, forgery: str) -> None:
        """Register a member's own incarnation again from elsewhere (the 6.6.6.6 attack)."""
        picked = self._pick(index)
        if picked is None:
            return
        node_id, incarnation = picked
        member = self.state.members[node_id]
        registration = reg(
            self.state,
            node_id,
            host="6.6.6.6" if forgery != "other credential" else member.host,
            port=member.port,
            role=member.role,
            incarnation=incarnation,
            cluster_id=JOB,
        )
        if forgery != "other host":
            registration = dataclasses.replace(
                registration, credential_digest=digest(node_id + "x", incarnation)
            )
            if self.state.settings.job_secret is not None:  # the forger knows the secret, even
                registration = dataclasses.replace(
                    registration,
                    proof=auth.prove(self.state.settings.job_secret, registration.message()),
                )
        before = _everything(self.state)
        outcome, effects = self.state.register(registration)
        assert isinstance(outcome, Refused), outcome
        assert effects == []
        assert _everything(self.state) == before
        event(f"forged registration refused: {outcome.reason.value}")

    @rule(
        index=st.integers(min_value=0, max_value=20),
        revision=st.sampled_from(
            [PROTOCOL_REVISION - 1, PROTOCOL_REVISION + 1, PROTOCOL_REVISION + 7]
        ),
        own=st.booleans(),
        proven=st.booleans(),
    )
    def other_revision_registers(self, index: int, revision: int, own: bool, proven: bool) -> None:
        """A node of another protocol revision is refused, naming both releases, and nothing
        changes: also a member's own process registering again (`own`: its credential, its
        address, its proof of the secret; all of it but its revision would be taken). With a
        job secret, one that does not prove it (`proven` False) is told its own release only
        (the scheduler logs both)."""
        picked = self._pick(index) if own else None
        if picked is not None:
            member = self.state.members[picked[0]]
            node_id, host, port, role = member.node_id, member.host, member.port, member.role
            incarnation, cluster_id = picked[1], JOB
        else:
            node_id = (WORKER_IDS + SERVER_IDS)[index % (len(WORKER_IDS) + len(SERVER_IDS))]
            role = NodeRole.SERVER if node_id in SERVER_IDS else NodeRole.WORKER
            host, port, incarnation, cluster_id = "h0", 5000, 20, ""
        registration = reg(
            self.state,
            node_id,
            host=host,
            port=port,
            role=role,
            incarnation=incarnation,
            cluster_id=cluster_id,
            protocol_revision=revision,
            cluster_version="9.9.9",
        )
        if not proven:
            registration = dataclasses.replace(registration, proof=b"")
        before = _everything(self.state)
        outcome, effects = self.state.register(registration)
        assert isinstance(outcome, Refused), outcome
        assert outcome.reason is Refusal.VERSION_MISMATCH
        ours = f"cluster {VERSION} (protocol revision {PROTOCOL_REVISION})"
        told = proven or self.state.settings.job_secret is None
        assert f"cluster 9.9.9 (protocol revision {revision})" in outcome.message
        assert (ours in outcome.message) is told
        assert ours in (outcome.logged or outcome.message)
        assert outcome.retry_after_s == 0
        assert effects == []
        assert _everything(self.state) == before
        event(f"another revision refused ({'a member' if picked else 'a new node'})")

    @rule(revision=st.sampled_from([0, PROTOCOL_REVISION + 1]))
    def scheduler_of_another_revision_restarts(self, revision: int) -> None:
        """What this scheduler saved is stamped with its revision: a scheduler of another
        revision refuses to resume it, whatever its phase; a state saved without the stamp
        (`revision` 0, by a release before it) is of revision 1."""
        saved = json.loads(json.dumps(self.state.snapshot()))
        assert saved["protocol_revision"] == PROTOCOL_REVISION
        assert saved["cluster_version"] == VERSION
        if revision:
            saved["protocol_revision"] = revision
        else:
            del saved["protocol_revision"], saved["cluster_version"]
        if version.revision_of(revision) == PROTOCOL_REVISION:
            SchedulerState.restore(saved, self.state.settings, self.clock, new_cluster_id="new")
            return
        stated = version.revision_of(revision)
        with pytest.raises(SnapshotError, match=f"saved by .* \\(protocol revision {stated}\\)"):
            SchedulerState.restore(saved, self.state.settings, self.clock, new_cluster_id="new")

    @rule(
        node_id=node_ids,
        forgery=st.sampled_from(["no proof", "wrong secret", "replay"]),
    )
    def outsider_registers(self, node_id: str, forgery: str) -> None:
        """A registration that does not prove the job secret, when the job has one."""
        if self.state.settings.job_secret is None:
            return
        role = NodeRole.SERVER if node_id in SERVER_IDS else NodeRole.WORKER
        if forgery == "replay":
            if not self.sent:
                return
            registration = self.sent[-1]
        elif forgery == "wrong secret":
            registration = reg(self.state, node_id, role=role, incarnation=5, secret=b"guess")
        else:
            registration = dataclasses.replace(
                reg(self.state, node_id, role=role, incarnation=5), proof=b""
            )
        before = _everything(self.state)
        outcome, effects = self.state.register(registration)
        assert isinstance(outcome, Refused), outcome
        # A replay is refused as seen before, or (later) as answering a stale challenge.
        allowed = (Refusal.NOT_A_MEMBER, Refusal.INVALID_NODE, Refusal.STALE_CHALLENGE)
        assert outcome.reason in allowed, outcome
        assert effects == []
        assert _everything(self.state) == before
        event(f"outsider refused ({forgery})")

    @invariant()
    def members_admit_their_own_process_only(self) -> None:
        """Each member's calls are admitted with the credential of its current incarnation,
        also after restarts of the node or of the scheduler."""
        if not hasattr(self, "state"):
            return
        secret = self.state.settings.job_secret
        for member in self.state.members.values():
            for incarnation in (member.incarnation, None):
                own = presented(secret, member.node_id, member.incarnation)
                verdict = self.state.admission.admit(member.node_id, incarnation, own)
                if secret is not None and member.node_id not in self.state.admission.call_windows:
                    # Not registered with this (restarted) scheduler yet: its calls wait.
                    assert isinstance(verdict, Denied)
                    assert verdict.kind is Denial.NOT_REGISTERED_HERE
                else:
                    assert verdict is member

    @invariant()
    def only_alive_members_are_awaited(self) -> None:
        """A restored member that failed or finished before it came back is awaited no more:
        it would hold the registration burst open (and every silence limit back) for
        MS_TOPO_TIMEOUT after the restart."""
        if not hasattr(self, "state"):
            return
        members = self.state.members
        for node_id in self.state.awaiting:
            assert node_id in members
            assert members[node_id].state is NodeState.ALIVE, node_id

    @invariant()
    def nothing_is_kept_of_a_node_that_is_gone(self) -> None:
        """What the machine keeps by node id is of its members and spares only: ids that come
        and go (forgotten while the job forms) leave nothing behind."""
        if not hasattr(self, "state"):
            return
        state = self.state
        kept = {
            *state.admission.call_windows,
            *state.rollback._put_back,
            *state.rollback._report_seq,
            *state.guard_waiting,
            *state.awaiting,
        }
        assert kept <= {*state.members, *state.spares}

    @rule(
        index=st.integers(min_value=0, max_value=20),
        steps=st.lists(st.sampled_from([10, 20, 30]), max_size=3),
    )
    def report_checkpoints(self, index: int, steps: list[int]) -> None:
        picked = self._pick(index)
        if picked is not None:
            seq = next(self.report_numbers)
            self.state.report_checkpoints(*picked, steps, self.state.generation, seq)

    @invariant()
    def never_too_many_members(self) -> None:
        if not hasattr(self, "state"):
            return
        state = self.state
        assert len(state.members) <= state.expected
        roles = Counter(m.role for m in state.members.values())
        assert roles[NodeRole.WORKER] <= state.settings.worker_num
        assert roles[NodeRole.SERVER] <= state.settings.server_num

    @invariant()
    def ranks_dense_unique_and_stable(self) -> None:
        if not hasattr(self, "state"):
            return
        state = self.state
        members = list(state.members.values())
        if state.generation == 0:
            assert all(m.rank is None for m in members)
            assert state.phase in (Phase.WAITING, Phase.FAILED)
            return
        assert state.generation == 1 or state.recovery
        assert state.phase is not Phase.WAITING
        for role, space in (
            (NodeRole.WORKER, state.settings.worker_num),
            (NodeRole.SERVER, state.settings.server_num),
        ):
            group = [m for m in members if m.role is role]
            assert sorted(m.rank for m in group if m.rank is not None) == list(range(space))
            # Numeric ids are their rank; the others follow (host, node id) order as the job
            # formed (a node that rejoins from another host keeps its rank: ranks are stable).
            if not hasattr(self, "formed_hosts"):
                self.formed_hosts = {m.node_id: m.host for m in members}
            for m in group:
                if m.node_id.isdigit():
                    assert m.rank == int(m.node_id)
            named = sorted((m for m in group if not m.node_id.isdigit()), key=lambda m: m.rank or 0)
            keys = [(self.formed_hosts.get(m.node_id, m.host), m.node_id) for m in named]
            assert keys == sorted(keys)
            # Local ranks are distinct among the role's members of a host, and the local size
            # is their number (0, 1, ... by rank as the job forms; a member that moves to
            # another host leaves a gap: the others keep theirs, tests/unit/test_spares.py).
            by_host: dict[str, list[int]] = {}
            for m in group:
                by_host.setdefault(m.host, []).append(m.local_rank)
                assert m.local_size == sum(1 for o in group if o.host == m.host)
            for local_ranks in by_host.values():
                assert len(set(local_ranks)) == len(local_ranks)
        for m in members:
            assert m.rank is not None
            assert self.assigned.setdefault(m.node_id, m.rank) == m.rank

    @invariant()
    def phase_matches_member_states(self) -> None:
        if not hasattr(self, "state"):
            return
        state = self.state
        states = [m.state for m in state.members.values()]
        if state.phase is Phase.WAITING:
            assert all(s is NodeState.ALIVE for s in states)
        if state.phase is Phase.FINISHED:
            assert all(s is NodeState.FINISHED for s in states)
        if state.phase is Phase.READY and not state.recovery:
            assert NodeState.FAILED not in states
        if state.phase is Phase.READY:
            assert NodeState.ALIVE in states or NodeState.FAILED in states


def _known(state: SchedulerState) -> dict[str, tuple[int, NodeState]]:
    return {k: (m.incarnation, m.state) for k, m in state.members.items()}


def _durable(state: SchedulerState) -> tuple[dict[str, object], int]:
    snapshot = state.snapshot()
    revision = snapshot.pop("revision")
    assert isinstance(revision, int)
    return snapshot, revision


SchedulerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
TestSchedulerProperties = SchedulerMachine.TestCase


def test_same_incarnation_from_another_host_keeps_peers_consistent() -> None:
    state = ready_state(FakeClock(), ["0", "1"], hosts=["h0", "h0"])
    state.register(reg(state, "1", host="h1"))
    for peer in state.peers():
        same_host = [p for p in state.peers() if p.host == peer.host]
        assert peer.local_size == len(same_host)
        assert peer.local_rank == same_host.index(peer)


# -- recovery ---------------------------------------------------------------------------------


def recovering(clock: FakeClock, n: int = 3) -> SchedulerState:
    return ready_state(clock, [str(i) for i in range(n)], recovery=True)


def test_with_recovery_a_dead_node_fails_alone() -> None:
    state = recovering(FakeClock())
    effects = state.disconnect("1", 1)
    assert [type(e) for e in effects] == [NodeFailedEvent, Evict]
    assert isinstance(effects[0], NodeFailedEvent)
    assert effects[0].rank == 1
    assert state.phase is Phase.READY
    assert state.members["1"].state is NodeState.FAILED


def test_a_silent_node_is_failed_and_its_stream_ended_so_it_must_register_again() -> None:
    clock = FakeClock()
    state = recovering(clock)
    clock.advance(10.5)
    for node_id in ("0", "2"):
        state.heartbeat(node_id, 1)
    effects = state.tick()
    assert Evict("1", 1, effects[0].reason) in effects  # type: ignore[union-attr]
    # Back with the same process when the network returns: a new generation, no guard.
    outcome, effects = state.register(reg(state, "1", incarnation=1, port=6001))
    assert isinstance(outcome, Accepted)
    assert outcome.rejoined
    assert state.generation == 2


def test_restarted_node_waits_for_the_guard_then_rejoins_with_its_rank() -> None:
    clock = FakeClock()
    state = recovering(clock)
    revision = state.revision
    state.disconnect("1", 1)
    assert state.revision > revision
    clock.advance(3.0)
    refusal = refuse(state, reg(state, "1", incarnation=2, port=7001), Refusal.NODE_ALIVE)
    assert refusal.retry_after_s == pytest.approx(7.0)
    assert "(failed)" in refusal.message
    clock.advance(7.01)
    outcome, effects = state.register(reg(state, "1", incarnation=2, port=7001, cluster_id=JOB))
    assert isinstance(outcome, Accepted)
    assert outcome.rejoined
    assert outcome.generation == 2
    assert Evict("1", 1, "replaced by a new process") in effects
    ready = [e for e in effects if isinstance(e, TopologyReadyEvent)]
    assert len(ready) == 1
    assert ready[0].generation == 2
    assert [(p.rank, p.port) for p in ready[0].peers] == [(0, 6000), (1, 7001), (2, 6002)]
    member = state.members["1"]
    assert (member.rank, member.state, member.restarts) == (1, NodeState.ALIVE, 1)
    assert state.catch_up() == ready


def test_a_live_node_id_cannot_be_taken_over() -> None:
    clock = FakeClock()
    state = recovering(clock)
    for _ in range(5):
        clock.advance(8.0)
        state.heartbeat("2", 1)
        refuse(state, reg(state, "2", incarnation=99), Refusal.NODE_ALIVE)
    assert state.members["2"].incarnation == 1
    assert state.generation == 1


def test_a_failed_node_that_never_comes_back_fails_the_job() -> None:
    clock = FakeClock()
    state = recovering(clock)  # node timeout 10 s, topology timeout 60 s
    state.disconnect("0", 1)
    for member in state.members.values():
        member.last_seen = clock.now
    clock.advance(69.0)
    for node_id in ("1", "2"):
        state.heartbeat(node_id, 1)
    assert state.tick() == []
    clock.advance(2.0)
    for node_id in ("1", "2"):
        state.heartbeat(node_id, 1)
    effects = state.tick()
    assert state.phase is Phase.FAILED
    assert isinstance(effects[-1], ShutdownEvent)
    assert "rank 0" in effects[-1].reason
    assert "did not rejoin within MS_TOPO_TIMEOUT=60 s" in effects[-1].reason


def test_job_with_a_failed_node_ends_only_when_it_rejoined_and_finished() -> None:
    clock = FakeClock()
    state = recovering(clock, n=2)
    state.disconnect("1", 1)
    assert state.finish("0", 1) == []
    clock.advance(11.0)
    accept(state, reg(state, "1", incarnation=2))
    effects = state.finish("1", 2)
    assert effects == [ShutdownEvent(True, "all 2 nodes finished")]


def test_same_process_back_after_it_was_declared_failed_rejoins_without_guard() -> None:
    state = recovering(FakeClock())
    state.disconnect("2", 1)
    outcome, effects = state.register(reg(state, "2", incarnation=1, port=6002))
    assert isinstance(outcome, Accepted)
    assert outcome.rejoined
    assert not any(isinstance(e, Evict) for e in effects)
    assert state.members["2"].restarts == 0
    assert state.generation == 2


def restore(
    snapshot: dict[str, object], clock: FakeClock, *, worker_num: int = 3
) -> SchedulerState:
    """`snapshot` restored by a scheduler of `worker_num` workers (a new job's id: job-2)."""
    settings = JobSettings(
        worker_num=worker_num,
        server_num=0,
        node_timeout_s=10.0,
        topo_timeout_s=60.0,
        heartbeat_interval_s=1.0,
        recovery=True,
    )
    return SchedulerState.restore(
        json.loads(json.dumps(snapshot)), settings, clock, new_cluster_id="job-2"
    )


def test_restored_scheduler_takes_back_its_nodes_with_their_ranks() -> None:
    clock = FakeClock()
    state = recovering(clock)
    state.disconnect("1", 1)
    clock.advance(11.0)
    accept(state, reg(state, "1", incarnation=2, port=7001))
    clock.advance(100.0)
    restored = restore(state.snapshot(), clock)
    assert (restored.cluster_id, restored.generation, restored.phase) == (JOB, 2, Phase.READY)
    assert restored.peers() == state.peers()
    assert restored.awaiting == {"0", "1", "2"}
    outcome, effects = restored.register(reg(restored, "1", incarnation=2, port=7001))
    assert isinstance(outcome, Accepted)
    assert not outcome.rejoined
    assert effects == []
    assert restored.connect("1", 2) == state.catch_up()
    assert state.catch_up() == [
        TopologyReadyEvent(2, state.peers(), 0, "rank 1 (node '1' at h0:7001) rejoined")
    ]
    assert restored.awaiting == {"0", "2"}


def test_restored_nodes_that_do_not_reconnect_fail() -> None:
    clock = FakeClock()
    restored = restore(recovering(clock).snapshot(), clock)
    for node_id in ("0", "1"):
        accept(restored, reg(restored, node_id, port=6000 + int(node_id)))
        restored.connect(node_id, 1)
    clock.advance(10.5)
    for node_id in ("0", "1"):
        restored.heartbeat(node_id, 1)
    effects = restored.tick()
    assert [type(e) for e in effects] == [NodeFailedEvent, Evict]
    assert isinstance(effects[0], NodeFailedEvent)
    assert "did not reconnect" in effects[0].reason
    assert restored.phase is Phase.READY


@pytest.mark.parametrize("finished", [0, 1])
def test_a_job_resumed_with_no_node_alive_says_what_it_waits_for(finished: int) -> None:
    """Every node timed out (or some finished) before the scheduler restarted: its log said
    "waiting ... for its 0 nodes to reconnect". It says that none is to reconnect, and that
    the failed ones are waited for to rejoin, until when."""
    clock = FakeClock()
    state = recovering(clock)
    for node_id in ("0", "1", "2"):
        if int(node_id) < finished:
            state.finish(node_id, 1)
        else:
            state.disconnect(node_id, 1)
    snapshot = state.snapshot()
    restored = restore(snapshot, clock)
    assert (restored.phase, restored.awaiting) == (Phase.READY, set())
    note = restored_note(restored, snapshot, "etcd://e1:2379/jobs/a")
    who = "all 3 of its nodes" if not finished else "2 of its 3 nodes"
    assert note.startswith(
        f"resuming job {JOB} from etcd://e1:2379/jobs/a: generation 1, with no node to "
        f"reconnect: {who} had failed"
    )
    assert ("had failed and 1 finished when it was saved" in note) == bool(finished)
    assert "each that failed to rejoin (started again), up to MS_TOPO_TIMEOUT=60 s" in note
    assert "0 nodes" not in note


def test_snapshot_while_forming_keeps_the_job_id_only() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=3, recovery=True)
    accept(state, reg(state, "0"))
    restored = restore(state.snapshot(), clock)
    assert (restored.cluster_id, restored.phase, restored.members) == (JOB, Phase.WAITING, {})
    accept(restored, reg(restored, "0", cluster_id=JOB))


def test_an_ended_job_is_not_resumed_and_its_nodes_may_join_the_next() -> None:
    clock = FakeClock()
    state = recovering(clock)
    for node_id in ("0", "1", "2"):
        state.finish(node_id, 1)
    restored = restore(state.snapshot(), clock)
    assert (restored.cluster_id, restored.previous_cluster_id) == ("job-2", JOB)
    assert restored.phase is Phase.WAITING
    accept(restored, reg(restored, "0", cluster_id=JOB))
    refusal = refuse(restored, reg(restored, "1", cluster_id="job-0"), Refusal.FOREIGN_JOB)
    assert "job-0" in refusal.message


def test_restore_with_other_worker_num_is_refused() -> None:
    with pytest.raises(SnapshotError, match=r"MS_WORKER_NUM=3.*MS_WORKER_NUM=4"):
        restore(recovering(FakeClock()).snapshot(), FakeClock(), worker_num=4)


def test_restore_by_a_scheduler_of_another_job_secret_is_refused() -> None:
    """The saved state records a keyed hash of the job's secret (never the secret): a
    scheduler of another secret, or of none, is another job's; a state saved before the
    field existed is taken as it is, and an ended job's is replaced whatever its secret."""
    clock = FakeClock()
    secret = dataclasses.replace(SETTINGS, worker_num=1, recovery=True, job_secret=b"s" * 32)
    saved = SchedulerState(JOB, secret, clock).snapshot()
    assert saved["trust"]
    assert not {"s" * 32, "73" * 32} & set(json.dumps(saved).split('"'))
    for other in (b"t" * 32, None):
        with pytest.raises(SnapshotError, match=f"it holds job {JOB}, which has"):
            SchedulerState.restore(
                saved,
                dataclasses.replace(secret, job_secret=other),
                clock,
                new_cluster_id="job-2",
            )
    assert SchedulerState.restore(saved, secret, clock, new_cluster_id="job-2").cluster_id == JOB
    older = {k: v for k, v in saved.items() if k != "trust"}
    open_job = dataclasses.replace(secret, job_secret=None)
    assert SchedulerState.restore(older, open_job, clock, new_cluster_id="x").cluster_id == JOB
    ended = {**saved, "phase": Phase.FINISHED.value}
    assert SchedulerState.restore(ended, open_job, clock, new_cluster_id="x").cluster_id == "x"


def test_restore_of_a_snapshot_missing_fields_is_refused() -> None:
    with pytest.raises(SnapshotError, match="lacks generation"):
        restore(
            {
                "cluster_id": "x",
                "worker_num": 1,
                "server_num": 0,
                "phase": "ready",
                "members": [],
                "protocol_revision": PROTOCOL_REVISION,
            },
            FakeClock(),
        )


# -- rollback ---------------------------------------------------------------------------------


def test_rollback_is_the_newest_step_every_worker_holds() -> None:
    clock = FakeClock()
    state = recovering(clock)
    state.report_checkpoints("0", 1, [10, 20, 30])
    state.report_checkpoints("1", 1, [20, 30])
    state.report_checkpoints("2", 1, [10, 20])  # has not saved 30 (yet)
    assert state.rollback_step() == 20
    state.disconnect("2", 1)
    clock.advance(11.0)
    _, effects = state.register(reg(state, "2", incarnation=2))
    (ready,) = [e for e in effects if isinstance(e, TopologyReadyEvent)]
    assert (ready.generation, ready.rollback_step) == (2, 20)
    assert "rank 2" in ready.reason


def test_the_step_every_worker_holds_is_computed_at_most_once_a_second() -> None:
    """What a checkpoint report is answered with: the rollback step as of a moment ago (at most
    HELD_BY_ALL_EVERY_S), never newer than what every worker holds; 0 when none in common."""
    clock = FakeClock()
    state = recovering(clock)
    assert state.held_by_all() == 0
    for node_id in ("0", "1", "2"):
        state.report_checkpoints(node_id, 1, [10, 20])
    clock.advance(HELD_BY_ALL_EVERY_S)
    assert state.held_by_all() == 20
    for node_id in ("0", "1", "2"):
        state.report_checkpoints(node_id, 1, [20, 30])
    assert state.held_by_all() == 20  # a moment ago: still held by every worker
    clock.advance(HELD_BY_ALL_EVERY_S)
    assert state.held_by_all() == 30 == state.rollback_step()
    state.report_checkpoints("2", 1, [5])  # no step in common: nothing to keep for it
    clock.advance(HELD_BY_ALL_EVERY_S)
    assert state.held_by_all() == 0


def test_a_worker_lost_before_its_first_checkpoint_makes_the_rollback_step_the_start() -> None:
    clock = FakeClock()
    state = recovering(clock, n=2)
    state.report_checkpoints("1", 1, [5])
    assert state.rollback_step() == 0
    state.disconnect("0", 1)
    clock.advance(11.0)
    _, effects = state.register(reg(state, "0", incarnation=2))
    ready = [e for e in effects if isinstance(e, TopologyReadyEvent)]
    assert state.phase is Phase.READY
    assert [(e.generation, e.rollback_step) for e in ready] == [(2, 0)]
    assert "no checkpoint on disk yet at rank 0" in ready[0].reason
    assert "step the survivors hold in memory if they can" in ready[0].reason


def test_rollback_is_the_beginning_when_nobody_has_a_checkpoint() -> None:
    state = recovering(FakeClock())
    assert state.rollback_step() == 0
    assert state.catch_up() == [TopologyReadyEvent(1, state.peers(), 0, "formed")]


def test_no_common_checkpoint_fails_the_job_with_what_each_holds() -> None:
    clock = FakeClock()
    state = recovering(clock, n=2)
    state.report_checkpoints("0", 1, [40, 50])
    state.report_checkpoints("1", 1, [10])
    none = state.rollback_step()
    assert isinstance(none, NoCommonStep)
    assert "rank 0 (node '0' at h0:6000): 40, 50; rank 1 (node '1' at h0:6001): 10" in none.message
    state.disconnect("1", 1)
    clock.advance(11.0)
    _, effects = state.register(reg(state, "1", incarnation=2))
    assert state.phase is Phase.FAILED
    assert isinstance(effects[-1], ShutdownEvent)
    assert "no checkpoint step is held by every worker" in effects[-1].reason
    assert "40, 50" in effects[-1].reason


def test_checkpoint_reports_are_saved_and_restored() -> None:
    clock = FakeClock()
    state = recovering(clock)
    revision = state.revision
    state.report_checkpoints("1", 1, [5, 10])
    assert state.revision > revision
    revision = state.revision
    state.report_checkpoints("1", 1, [10, 5])
    assert state.revision == revision  # the same holdings: nothing to save
    restored = restore(state.snapshot(), clock)
    assert restored.members["1"].checkpoints == (5, 10)
    assert restored.restored_generation == 1


@pytest.mark.parametrize("new_incarnation", [7, 10**6])
def test_a_restarted_process_reports_are_taken_whatever_its_incarnation(
    new_incarnation: int,
) -> None:
    """Incarnations are random and each process numbers its reports from 1: a new process of a
    node id whose incarnation drew lower than its predecessor's had every report ignored, and
    the step every worker holds stayed where the dead process left it. Within one process, an
    older report that arrives late is still ignored."""
    clock = FakeClock()
    state = make_state(clock, worker_num=2, recovery=True)
    for node_id in ("0", "1"):
        accept(state, reg(state, node_id, incarnation=1000))
    for seq, steps in enumerate([[10], [10, 20], [10, 20]], 1):
        for node_id in ("0", "1"):
            state.report_checkpoints(node_id, 1000, steps, state.generation, seq)
    state.disconnect("1", 1000)
    clock.advance(11.0)
    accept(state, reg(state, "1", incarnation=new_incarnation))
    for seq, steps in enumerate([[20, 30], [20, 30, 40]], 1):
        clock.advance(HELD_BY_ALL_EVERY_S)
        state.report_checkpoints("0", 1000, steps, state.generation, 3 + seq)
        state.report_checkpoints("1", new_incarnation, steps, state.generation, seq)
        assert state.members["1"].checkpoints == tuple(steps)
    assert state.held_by_all() == 40 == state.rollback_step()
    state.report_checkpoints("1", new_incarnation, [20, 30], state.generation, 1)  # late
    assert state.members["1"].checkpoints == (20, 30, 40)


def test_reform_publishes_a_new_generation_with_the_rollback_step() -> None:
    state = recovering(FakeClock(), n=2)
    for node_id in ("0", "1"):
        state.report_checkpoints(node_id, 1, [7])
    (ready,) = state.reform("a collective was cut off")
    assert isinstance(ready, TopologyReadyEvent)
    assert (ready.generation, ready.rollback_step, ready.reason) == (
        2,
        7,
        "a collective was cut off",
    )


def test_a_tick_that_ends_the_job_keeps_the_failures_it_found_before() -> None:
    """One tick: node 0 goes silent (failed, its stream ended) and node 1's rejoin window ends
    (the job fails). The failure of node 0 is applied to the state, so it must be told too."""
    clock = FakeClock()
    state = recovering(clock)  # node timeout 10 s, topology timeout 60 s
    state.disconnect("1", 1)
    clock.advance(65.0)
    for node_id in ("0", "2"):
        state.heartbeat(node_id, 1)
    clock.advance(10.5)  # node 0 silent past the guard; node 1 failed 75.5 s ago
    state.heartbeat("2", 1)
    effects = state.tick()
    assert state.members["0"].state is NodeState.FAILED
    assert state.phase is Phase.FAILED
    failed = [e for e in effects if isinstance(e, NodeFailedEvent)]
    assert [e.node_id for e in failed] == ["0"]
    assert Evict("0", 1, failed[0].reason) in effects
    assert isinstance(effects[-1], ShutdownEvent)
    assert "rank 1" in effects[-1].reason


@settings(max_examples=1, database=None)
@given(st.none())
def test_a_named_node_rejoining_from_another_host_keeps_its_rank(nothing: None) -> None:
    """A case the machine found: ps-a rejoins from h1 after the job formed on h0. Its rank is
    stable, so the ranks no longer follow the hosts' order, only the order the job formed in.
    (Under `given` so that the machine's rules may record hypothesis events.)"""
    machine = SchedulerMachine()
    machine.setup(
        worker_num=1,
        server_num=2,
        heartbeat_enabled=False,
        topo_timeout_s=15.0,
        recovery=True,
        job_secret=None,
    )
    machine.fill(hosts=["h0"] * 6)
    machine.ranks_dense_unique_and_stable()
    rank = machine.state.members["ps-a"].rank
    machine.advance(seconds=11.0)
    machine.register(cluster_id="", host="h1", incarnation=2, matching=1, node_id="ps-a")
    machine.ranks_dense_unique_and_stable()
    assert machine.state.members["ps-a"].host == "h1"
    assert machine.state.members["ps-a"].rank == rank
    machine.teardown()


def test_a_registrations_word_on_its_collectives_counts_only_in_the_restored_generation() -> None:
    """`collectives_report`: what the rounds weigh of a node back after a restart (its rank,
    how far its collectives got), only for the generation restored while it still runs."""
    clock = FakeClock()
    state = restore(recovering(clock).snapshot(), clock)
    assert state.restored_generation == state.generation == 1
    again = reg(state, "1", port=6001, collectives_generation=1, collectives_answered=4)
    assert state.collectives_report(again) == (1, state.members["1"].rank, 4)
    first = reg(state, "1", port=6001)
    assert state.collectives_report(first) is None  # nothing answered: nothing to weigh
    older = dataclasses.replace(again, collectives_generation=0)
    assert state.collectives_report(older) is None
    stranger = reg(state, "9", collectives_generation=1, collectives_answered=4)
    assert state.collectives_report(stranger) is None  # no rank here
    state.reform("a test moves the job on")
    assert state.generation == 2
    assert state.collectives_report(again) is None  # the restored generation is over
