"""A node's Heartbeat stream opens, bounded by a pure rule with an injected clock
(`cluster.scheduler.machine.member_bounds.OpenRate`, on the loop `MemberLimits.stream_open`):
at most a burst at once, then one per `every_s`; a refused open takes nothing, and a real
worker's opens (one per lost connection or change of scheduler) are never refused."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.errors import CapacityError
from cluster.scheduler.machine.member_bounds import (
    OPEN_EVERY_S,
    OPENS_BURST,
    OVER_OPENS,
    OpenRate,
)
from cluster.scheduler.member_limits import MemberLimits
from tests.aio import BOUND_S, settle

# Times in ticks of 1/1024 s (sums of them are exact in a float), so that the rule can be
# checked against a token bucket counted in fractions.
TICK = 1 / 1024
gaps = st.lists(st.integers(0, 3_000), max_size=200)


class Bucket:
    """The token bucket the rule stands for, counted exactly: `burst` tokens, one more per
    `every_ticks`, an open takes one."""

    def __init__(self, burst: int, every_ticks: int) -> None:
        self.burst, self.every_ticks = burst, every_ticks
        self.tokens, self.at = Fraction(burst), 0

    def take(self, now: int) -> bool:
        self.tokens = min(
            Fraction(self.burst), self.tokens + Fraction(now - self.at, self.every_ticks)
        )
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@given(gaps, st.integers(1, 8), st.integers(1, 2_000))
def test_opens_are_taken_as_a_token_bucket_of_burst_refilled_once_a_period(
    gaps: list[int], burst: int, every_ticks: int
) -> None:
    rate: OpenRate[str] = OpenRate(burst, every_ticks * TICK)
    bucket, now, refused = Bucket(burst, every_ticks), 0, 0
    for gap in gaps:
        now += gap
        taken = rate.take("0", now * TICK) is None
        assert taken == bucket.take(now)
        refused += not taken
    assert rate.refused == refused


@given(gaps, st.integers(1, 8), st.integers(1, 2_000))
def test_opens_taken_in_any_window_are_at_most_the_burst_and_one_a_period(
    gaps: list[int], burst: int, every_ticks: int
) -> None:
    rate: OpenRate[str] = OpenRate(burst, every_ticks * TICK)
    now, taken = 0, []
    for gap in gaps:
        now += gap
        if rate.take("0", now * TICK) is None:
            taken.append(now)
    for i, start in enumerate(taken):
        for j in range(i, len(taken)):
            assert j - i + 1 <= burst + (taken[j] - start) // every_ticks


@given(st.lists(st.integers(0, 60_000), max_size=100), st.integers(1, 8))
def test_a_real_workers_opens_a_period_apart_or_fewer_than_a_burst_are_never_refused(
    extra_ticks: list[int], burst: int
) -> None:
    """A worker reopens after a lost connection, at most once a heartbeat interval, and joins
    again after a change of scheduler: opens a period apart at least are all taken, and so is
    a burst of them after a quiet period."""
    every_ticks = 5_120
    rate: OpenRate[str] = OpenRate(burst, every_ticks * TICK)
    now = 0
    for extra in extra_ticks:
        now += every_ticks + extra
        assert rate.take("0", now * TICK) is None
    now += burst * every_ticks
    assert all(rate.take("0", now * TICK) is None for _ in range(burst))


@given(gaps, st.integers(1, 4))
def test_a_refused_open_takes_nothing_and_says_when_the_next_is_taken(
    gaps: list[int], burst: int
) -> None:
    rate: OpenRate[str] = OpenRate(burst, 1.0)
    now = 0
    for gap in gaps:
        now += gap
        refused = rate.take("0", now * TICK)
        if refused is None:
            continue
        assert 0 < refused.wait_s <= 1.0
        # Refused again and again meanwhile: the next is still taken when it said, not sooner.
        wait = round(refused.wait_s / TICK)
        assert wait * TICK == refused.wait_s
        assert rate.take("0", (now + wait - 1) * TICK) is not None
        now += wait
        assert rate.take("0", now * TICK) is None


def test_each_node_has_its_own_rate_and_nodes_that_come_and_go_leave_nothing() -> None:
    rate: OpenRate[str] = OpenRate(2, 5.0)
    assert rate.take("0", 0.0) is None
    assert rate.take("0", 0.0) is None
    assert rate.take("0", 0.0) is not None
    assert rate.take("1", 0.0) is None  # another node is not held back
    for i in range(1000):  # nodes that come and go (each open once, then no more)
        assert rate.take(f"n{i}", 100.0 + 20 * i) is None
    assert len(rate._full_at) < 200
    assert rate.take("0", 20_000.0) is None  # its bucket full again long since


@given(gaps, st.integers(0, 3))
def test_a_refusal_is_held_at_most_the_hold_and_the_wait_and_few_of_a_node_at_once(
    gaps: list[int], holds: int
) -> None:
    rate: OpenRate[str] = OpenRate(2, 1.0, hold_s=0.5, holds=holds)
    now, held = 0, 0
    for gap in gaps:
        now += gap
        if gap % 2 and held:  # a held refusal answered
            rate.answered("0")
            held -= 1
        refused = rate.take("0", now * TICK)
        if refused is None:
            continue
        assert refused.hold_s <= min(refused.wait_s, 0.5)
        assert (refused.hold_s > 0) == (held < holds)  # past `holds` held, answered at once
        held += refused.hold_s > 0
        assert rate.holding("0") == held <= holds
    for _ in range(held):
        rate.answered("0")
    assert not rate._held


async def test_a_node_opening_streams_too_often_is_refused_named_and_counted() -> None:
    now = [0.0]
    limits = MemberLimits(2, 1.0, lambda: now[0])
    for _ in range(OPENS_BURST):
        await limits.stream_open("0", "10.0.0.1")
    # Refused, its answer held: the node's opener waits, and one that goes away is let go.
    gone = asyncio.ensure_future(limits.stream_open("0", "10.0.0.1"))
    await settle(lambda: limits.opens.holding("0") == 1)
    assert not gone.done()
    gone.cancel()
    await settle(lambda: limits.opens.holding("0") == 0)
    limits.opens.hold_s = 0.01  # a short hold, for the answer
    with pytest.raises(CapacityError) as refused:
        await asyncio.wait_for(limits.stream_open("0", "10.0.0.1"), BOUND_S)
    assert limits.opens.holding("0") == 0
    message = str(refused.value)
    for words in (
        "Heartbeat stream of node '0' (from 10.0.0.1) refused",
        f"{OPENS_BURST} at once",
        f"one per {OPEN_EVERY_S:g} s",
        "the stream it has open goes on",
        "at most once a heartbeat interval",
        f"the next is taken in {OPEN_EVERY_S:.1f} s",
    ):
        assert words in message, message
    assert limits.counts == {("Heartbeat", OVER_OPENS): 2}
    await limits.stream_open("1", "10.0.0.2")  # another node opens its own
    now[0] += OPEN_EVERY_S
    await limits.stream_open("0", "10.0.0.1")  # one a period again
