"""The job's events: what the state machine's inputs and effects become
(cluster.scheduler.machine.events), and the scheduler's journal that stamps, keeps, follows and
writes them (cluster.scheduler.events)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from cluster.protocol import version
from cluster.protocol.config import Limits
from cluster.protocol.errors import CapacityError, FellBehindError
from cluster.protocol.settings import JobSettings
from cluster.scheduler.events import FOLLOWER_BACKLOG, EventJournal
from cluster.scheduler.machine import events
from cluster.scheduler.machine.events import Cause, JobEvent, Kind, Record
from cluster.scheduler.machine.state import (
    Accepted,
    NodeFailedEvent,
    NodeRole,
    Phase,
    Refusal,
    Refused,
    Registration,
    SchedulerState,
    TopologyReadyEvent,
)
from cluster.testing import wait_until
from tests.aio import BOUND_S, settle
from tests.conftest import FakeClock
from tests.credentials import digest


def make_state(
    clock: FakeClock, workers: int = 2, *, recovery: bool = True, limits: Limits | None = None
) -> SchedulerState:
    settings = JobSettings(
        worker_num=workers,
        server_num=0,
        node_timeout_s=10.0,
        topo_timeout_s=60.0,
        heartbeat_interval_s=1.0,
        recovery=recovery,
        limits=limits or Limits(),
    )
    return SchedulerState("job-1", settings, clock)


def reg(node_id: str, incarnation: int = 1, workers: int = 2) -> Registration:
    return Registration(
        node_id,
        NodeRole.WORKER,
        "h0",
        6000,
        incarnation,
        workers,
        0,
        protocol_revision=version.PROTOCOL_REVISION,
        credential_digest=digest(node_id, incarnation),
    )


def formed(clock: FakeClock, workers: int = 2) -> SchedulerState:
    st = make_state(clock, workers)
    for i in range(workers):
        st.register(reg(str(i), workers=workers))
    assert st.phase is Phase.READY
    return st


def failures(effects: list[object]) -> list[NodeFailedEvent]:
    return [e for e in effects if isinstance(e, NodeFailedEvent)]


# -- the cause of a failure, for every way the state machine fails a node --------------------


def test_a_broken_stream_is_cause_stream_broken() -> None:
    st = formed(FakeClock())
    st.connect("1", 1)
    (failed,) = failures(st.disconnect("1", 1))
    assert events.failure_cause(failed.reason) is Cause.STREAM_BROKEN


def test_heartbeat_silence_is_cause_heartbeat_silence() -> None:
    clock = FakeClock()
    st = formed(clock)
    clock.now += 11.0
    found = failures(st.tick())
    assert found
    assert {events.failure_cause(f.reason) for f in found} == {Cause.HEARTBEAT_SILENCE}


def test_not_reconnecting_after_a_restart_is_cause_no_reconnect() -> None:
    clock = FakeClock()
    state = formed(clock)
    restored = SchedulerState.restore(
        state.snapshot(), state.settings, clock, new_cluster_id="job-2"
    )
    clock.now += 11.0
    found = failures(restored.tick())
    assert {events.failure_cause(f.reason) for f in found} == {Cause.NO_RECONNECT}


def test_a_new_process_taking_a_silent_nodes_id_is_cause_replaced() -> None:
    clock = FakeClock()
    st = formed(clock)
    clock.now += 10.5  # past the guard, before the next tick notices the silence
    _, effects = st.register(reg("1", incarnation=2))
    (failed,) = failures(effects)
    assert events.failure_cause(failed.reason) is Cause.REPLACED


def test_an_unknown_reason_is_cause_other() -> None:
    assert events.failure_cause("struck by lightning") is Cause.OTHER


# -- records ----------------------------------------------------------------------------------


def test_registrations_are_events_and_a_retry_is_none() -> None:
    clock = FakeClock()
    st = make_state(clock)
    outcome, _ = st.register(reg("0"))
    record = events.of_registration(reg("0"), None, outcome, st)
    assert record is not None
    assert record.kind is Kind.REGISTERED
    assert record.fields == {
        "node_id": "0",
        "role": "worker",
        "address": "h0:6000",
        "registered": 1,
        "expected": 2,
    }
    again, _ = st.register(reg("0"))
    assert events.of_registration(reg("0"), 1, again, st) is None


def test_a_guard_refusal_and_a_refusal_are_told_apart() -> None:
    clock = FakeClock()
    st = formed(clock)
    guarded, _ = st.register(reg("1", incarnation=2))
    record = events.of_registration(reg("1", 2), 1, guarded, st)
    assert record is not None
    assert record.kind is Kind.GUARD_REFUSAL
    assert record.fields["node_id"] == "1"
    assert record.fields["retry_after_s"] > 0
    full, _ = st.register(reg("7", workers=3))
    record = events.of_registration(reg("7", workers=3), None, full, st)
    assert record is not None
    assert (record.kind, record.fields["reason"]) == (
        Kind.REFUSED,
        Refusal.WORKER_NUM_MISMATCH.value,
    )


def test_a_rejoin_names_the_rank_and_the_new_generation_its_rollback_step() -> None:
    clock = FakeClock()
    st = formed(clock)
    st.connect("1", 1)
    st.disconnect("1", 1)
    clock.now += 11.0
    outcome, effects = st.register(reg("1", incarnation=2))
    assert isinstance(outcome, Accepted)
    record = events.of_registration(reg("1", 2), 1, outcome, st)
    assert record is not None
    assert (record.kind, record.fields["rank"], record.fields["restarts"]) == (Kind.REJOINED, 1, 1)
    (topology,) = [e for e in effects if isinstance(e, TopologyReadyEvent)]
    generation = events.of_effect(topology, st)
    assert generation is not None
    assert generation.kind is Kind.GENERATION
    assert generation.fields["generation"] == 2
    assert generation.fields["rollback_step"] == 0


def test_formed_failed_and_the_end_are_events_and_progress_is_not() -> None:
    clock = FakeClock()
    st = make_state(clock)
    _, first = st.register(reg("0"))
    assert [events.of_effect(e, st) for e in first] == [None]  # a progress count
    clock.now += 1.5
    _, effects = st.register(reg("1"))
    kinds = [r.kind for r in (events.of_effect(e, st) for e in effects) if r is not None]
    assert kinds == [Kind.FORMED]
    record = events.of_effect(effects[-1], st)
    assert record is not None
    assert record.fields == {"generation": 1, "nodes": 2, "seconds": 1.5}
    st.connect("0", 1)
    (failed, *_) = st.disconnect("0", 1)
    record = events.of_effect(failed, st)
    assert record is not None
    assert (record.kind, record.fields["rank"], record.fields["cause"]) == (
        Kind.FAILED,
        0,
        "stream_broken",
    )
    ended = events.of_effect(st.abort("stopped by an operator")[0], st)
    assert ended is not None
    assert (ended.kind, ended.fields) == (Kind.JOB_FAILED, {"detail": "stopped by an operator"})


def test_an_event_line_reads_back() -> None:
    event = JobEvent(7, 1_700_000_000.25, "failed", {"rank": 2, "reason": 'a "quoted" reason'})
    line = event.to_json()
    assert "\n" not in line
    assert json.loads(line)["time"] == "2023-11-14T22:13:20.250+00:00"
    assert JobEvent.from_json(line) == event
    with pytest.raises(ValueError, match="needs time, seq and event"):
        JobEvent.from_json('{"hello": 1}')


# -- the journal --------------------------------------------------------------------------------


def journal(retain: int = 100) -> tuple[EventJournal, SchedulerState]:
    st = make_state(FakeClock())
    return EventJournal(st, wall=lambda: 1_700_000_000.0, retain=retain), st


def test_the_journal_keeps_a_bounded_number_of_events() -> None:
    book, _ = journal(retain=3)
    for i in range(5):
        book.emit(Record(Kind.REFUSED, {"node_id": str(i)}))
    assert [e.seq for e in book.history()] == [3, 4, 5]
    assert [e.seq for e in book.history(after=4)] == [5]


async def test_a_follower_gets_the_history_then_each_event_until_the_jobs_last() -> None:
    book, _ = journal()
    book.emit(Record(Kind.STARTED))
    got: list[str] = []

    async def read() -> None:
        async for event in book.follow():
            got.append(event.kind)

    reader = asyncio.create_task(read())
    await settle(lambda: got == ["started"])
    book.emit(Record(Kind.FORMED))
    book.emit(Record(Kind.FINISHED, {"detail": "all 2 nodes finished"}))
    book.emit(Record(Kind.NODES_BACK))  # after the job's last: not followed
    await asyncio.wait_for(reader, BOUND_S)
    assert got == ["started", "formed", "finished"]


async def test_a_follower_that_falls_behind_is_ended_with_a_reason() -> None:
    book, _ = journal(retain=10)
    stream = book.follow()
    book.emit(Record(Kind.STARTED))
    assert (await asyncio.wait_for(stream.__anext__(), BOUND_S)).kind == "started"
    for _ in range(FOLLOWER_BACKLOG + 1):
        book.emit(Record(Kind.REFUSED))

    async def drain() -> None:
        async for _ in stream:
            pass

    with pytest.raises(FellBehindError, match="fell behind \\(over 10000 events"):
        await asyncio.wait_for(drain(), BOUND_S)


async def test_followers_ended_for_falling_behind_hold_nothing_and_keep_their_place() -> None:
    """Readers that stop reading (gRPC's flow control holds their streams at a yield) and are
    ended for falling behind: what they had waiting is dropped, so their next read is the
    FellBehindError, and each counts against CLUSTER_MAX_FOLLOWERS until its stream is gone,
    so that readers coming in cohorts hold at most `max_followers` streams' worth, not each
    cohort's backlog of FOLLOWER_BACKLOG events."""
    st = make_state(FakeClock(), limits=Limits(max_followers=2))
    book = EventJournal(st, wall=lambda: 1_700_000_000.0, retain=10)
    stuck = []
    for _ in range(2):
        stream = book.follow(book.seq)
        book.emit(Record(Kind.STARTED))
        assert (await asyncio.wait_for(anext(stream), BOUND_S)).kind == "started"
        stuck.append(stream)  # its reader reads no more
    for _ in range(FOLLOWER_BACKLOG + 1):
        book.emit(Record(Kind.REFUSED))
    with pytest.raises(CapacityError, match="CLUSTER_MAX_FOLLOWERS"):
        await asyncio.wait_for(anext(book.follow(book.seq)), BOUND_S)  # theirs are open
    for stream in stuck:  # a reader that reads again gets the end at once, no stale event
        with pytest.raises(FellBehindError, match="fell behind"):
            await asyncio.wait_for(anext(stream), BOUND_S)
    book.emit(Record(Kind.FORMED))
    again = book.follow(book.seq - 1)  # their places are free once their streams are gone
    assert (await asyncio.wait_for(anext(again), BOUND_S)).kind == "formed"
    await again.aclose()


def test_the_file_gets_one_line_per_event_and_a_new_scheduler_numbers_on(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "events.jsonl"
    first, _ = journal()
    first.open(path)
    first.emit(Record(Kind.STARTED))
    first.emit(Record(Kind.FORMED, {"generation": 1}))
    first.close()
    second, _ = journal()
    second.open(path)
    second.emit(Record(Kind.RESUMED))
    second.close()
    lines = path.read_text().splitlines()
    assert [JobEvent.from_json(line).seq for line in lines] == [1, 2, 3]
    assert [json.loads(line)["event"] for line in lines] == ["started", "formed", "resumed"]


def test_a_failing_event_log_is_said_once_and_the_job_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    book, _ = journal()
    with caplog.at_level(logging.ERROR, logger="cluster.scheduler"):
        book.open(blocker / "events.jsonl")
        for _ in range(3):
            book.emit(Record(Kind.REFUSED))
        wait_until(lambda: "cannot write the event log" in caplog.text, 10, "the error")
        book.close()
    assert caplog.text.count("cannot write the event log") == 1
    assert "mscluster events --addr" in caplog.text
    assert [e.seq for e in book.history()] == [1, 2, 3]  # kept in memory all the same


def test_a_node_waiting_out_its_guard_is_one_event_not_one_per_retry() -> None:
    clock = FakeClock()
    st = formed(clock)
    first, _ = st.register(reg("1", incarnation=2))
    assert events.of_registration(reg("1", 2), 1, first, st) is not None
    clock.now += 1.0  # it asks again a second later, still within the guard
    again, _ = st.register(reg("1", incarnation=2))
    assert isinstance(again, Refused)
    assert events.of_registration(reg("1", 2), 1, again, st, was_waiting=True) is None


def test_every_guard_wait_of_a_node_is_one_event() -> None:
    """The engine asks whether the node waits already before it registers it (as `core`
    does): once a node was taken back after a guard wait, its next wait was never journaled
    nor counted, since nothing took it off the waiting list but the end of the job."""
    clock = FakeClock()
    st = formed(clock)
    for incarnation in (2, 3):
        st.disconnect("1", incarnation - 1)
        clock.now += 1.0
        kinds = []
        for _ in range(2):  # refused, and refused again a second later
            waiting = "1" in st.guard_waiting
            outcome, _ = st.register(reg("1", incarnation))
            record = events.of_registration(
                reg("1", incarnation), incarnation - 1, outcome, st, was_waiting=waiting
            )
            kinds.append(None if record is None else record.kind)
            clock.now += 1.0
        assert kinds == [Kind.GUARD_REFUSAL, None]
        clock.now += 10.0
        taken, _ = st.register(reg("1", incarnation))
        assert isinstance(taken, Accepted)
        assert taken.rejoined
        assert st.guard_waiting == {}
        st.connect("1", incarnation)
