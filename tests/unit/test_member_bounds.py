"""The pure rules of what one member may make the scheduler hold or do
(`cluster.scheduler.machine.member_bounds`): calls and request bytes in flight within a share
of a total, beats taken at most once a gap, changing checkpoint reports taken once a turn."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.errors import CapacityError
from cluster.scheduler.machine.member_bounds import (
    BYTES_FLOOR,
    CALLS_FLOOR,
    OVER_BYTES,
    OVER_CALLS,
    BeatGate,
    InFlight,
    ReportPacer,
    share,
)

MIB = 1024 * 1024


def test_shares_scale_with_the_job_down_to_a_floor() -> None:
    assert share(128, 2, 32) == 64
    assert share(128, 1024, 32) == 32
    small, large = InFlight(2), InFlight(4096)
    assert small.call_share > large.call_share == CALLS_FLOOR
    assert small.byte_share > large.byte_share == BYTES_FLOOR


def test_a_member_past_its_share_of_calls_is_refused_and_named_the_others_go_on() -> None:
    flight = InFlight(2, calls_total=8, bytes_total=64 * MIB)
    share_ = flight.call_share
    assert all(flight.open("0@h") is None for _ in range(share_))
    over = flight.open("0@h")
    assert over is not None
    assert over.reason == OVER_CALLS
    error = over.error("KvSet", "node '0' (from h)")
    assert isinstance(error, CapacityError)
    for words in ("KvSet", "node '0' (from h)", f"{share_} calls", "wait for its calls"):
        assert words in str(error)
    assert flight.open("1@h") is None  # another member is not held back
    flight.close("0@h", 0)
    assert flight.open("0@h") is None


def test_a_members_only_request_is_taken_whatever_its_size_then_bytes_are_bounded() -> None:
    flight = InFlight(2, bytes_total=2 * BYTES_FLOOR)
    assert flight.open("0@h") is None
    assert flight.request("0@h", 10 * flight.byte_share) is None  # the edge caps a message
    assert flight.open("0@h") is None
    over = flight.request("0@h", 1)
    assert over is not None
    assert over.reason == OVER_BYTES
    flight.close("0@h", 0)
    flight.close("0@h", 10 * flight.byte_share)
    assert flight.held("0@h") == (0, 0)


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 8 * MIB), st.booleans()),
        max_size=80,
    )
)
def test_what_a_member_holds_stays_within_its_shares_and_is_all_given_back(
    steps: list[tuple[str, int, bool]],
) -> None:
    flight = InFlight(4, calls_total=32, bytes_total=64 * MIB)
    open_calls: dict[str, list[int]] = {"a": [], "b": []}
    for key, size, end_one in steps:
        if end_one and open_calls[key]:
            flight.close(key, open_calls[key].pop())
            continue
        if flight.open(key) is not None:
            assert len(open_calls[key]) == flight.call_share
            continue
        counted = 0 if flight.request(key, size) is not None else size
        if not counted and size and flight.held(key)[1] == 0:
            raise AssertionError("a member's only request must be taken")
        open_calls[key].append(counted)
        calls, held = flight.held(key)
        assert calls == len(open_calls[key]) <= flight.call_share
        assert held == sum(open_calls[key])
        assert held <= flight.byte_share or len([s for s in open_calls[key] if s]) == 1
    for key, sizes in open_calls.items():
        for size in sizes:
            flight.close(key, size)
        assert flight.held(key) == (0, 0)
    assert not flight._calls
    assert not flight._bytes


@given(st.lists(st.floats(0, 0.3), max_size=200))
def test_beats_are_taken_at_most_once_a_gap_the_rest_dropped_and_counted(
    gaps: list[float],
) -> None:
    gate: BeatGate[str] = BeatGate(0.25)
    now, taken = 0.0, []
    for gap in gaps:
        now += gap
        if gate.take("n", now):
            taken.append(now)
    assert all(b - a >= 0.25 for a, b in itertools.pairwise(taken))
    assert gate.dropped == len(gaps) - len(taken)


def test_a_beat_a_gap_after_the_last_is_taken_and_old_keys_are_forgotten() -> None:
    gate: BeatGate[tuple[str, int]] = BeatGate(1.0)
    assert gate.take(("0", 1), 0.0)
    assert not gate.take(("0", 1), 0.5)
    assert gate.take(("0", 1), 1.0)
    assert gate.take(("1", 1), 1.0)
    for i in range(1000):  # keys that come and go (restarted processes)
        gate.take((str(i), 2), 10.0 + 2 * i)
    assert len(gate._last) < 200


def test_a_report_that_changes_nothing_is_free_a_changing_one_waits_its_turn() -> None:
    pacer: ReportPacer[str] = ReportPacer(0.1)
    assert pacer.offer("0", "r1", changes=True, now=0.0) is None  # the first: at once
    assert pacer.offer("0", "same", changes=False, now=0.01) is None  # free
    assert pacer.offer("0", "r2", changes=True, now=0.02) == 0.1  # waits for its turn
    assert pacer.offer("0", "r3", changes=True, now=0.05) == 0.1  # overtakes r2
    assert pacer.offer("1", "x", changes=True, now=0.05) is None  # another member's own turn
    assert pacer.coalesced == 1
    assert pacer.due("0", 0.1) == "r3"  # the newest is taken
    assert pacer.due("0", 0.1) is None
    assert pacer.offer("0", "r4", changes=True, now=0.15) == 0.2  # a turn after r3


@given(st.lists(st.tuples(st.floats(0, 0.05), st.booleans()), max_size=200))
def test_a_members_changing_reports_are_taken_at_most_once_a_turn_the_newest_winning(
    offers: list[tuple[float, bool]],
) -> None:
    pacer: ReportPacer[int] = ReportPacer(0.1)
    now, taken_changing, due_at = 0.0, [], None
    last_offered = -1
    for i, (gap, changes) in enumerate(offers):
        now += gap
        if due_at is not None and now >= due_at:
            report = pacer.due("m", due_at)
            assert report == last_offered  # the newest that waited
            taken_changing.append(due_at)
            due_at = None
        at = pacer.offer("m", i, changes=changes, now=now)
        last_offered = i
        if at is None:
            if changes:
                taken_changing.append(now)
        else:
            assert due_at is None or at == due_at
            due_at = at
    assert all(b - a >= 0.1 - 1e-9 for a, b in itertools.pairwise(taken_changing))
