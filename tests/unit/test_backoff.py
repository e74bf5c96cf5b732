"""cluster.protocol.backoff: the delays between attempts that keep failing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.backoff import (
    GUARD_TRIES_PER_S,
    JITTER,
    LISTEN_FAST_S,
    LISTEN_SLOW_TRY_S,
    LISTEN_TRIES_PER_S,
    LISTEN_TRY_S,
    Backoff,
    Spread,
    guard_pause_s,
    guard_poll_s,
    jittered,
    listen_every_s,
    listen_pace,
)
from cluster.protocol.records import GUARD_POLL_S


def test_the_delays_double_up_to_the_ceiling_and_start_again_after_a_reset() -> None:
    backoff = Backoff(0.1, 0.5)
    assert [backoff.next_s() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.reset()
    assert backoff.next_s() == 0.1


@given(st.floats(1e-3, 10.0), st.floats(1.0, 100.0), st.integers(0, 50))
def test_a_delay_is_never_below_the_first_nor_above_the_ceiling(
    first: float, factor: float, attempts: int
) -> None:
    backoff = Backoff(first, first * factor)
    delays = [backoff.next_s() for _ in range(attempts)]
    assert all(first <= d <= first * factor for d in delays)
    assert delays == sorted(delays)


def test_a_backoff_that_could_not_wait_is_refused() -> None:
    with pytest.raises(ValueError, match="first_s=0"):
        Backoff(0, 1.0)
    with pytest.raises(ValueError, match="max_s=1"):
        Backoff(2.0, 1.0)


@given(st.floats(0.0, 3600.0), st.integers(1, 1_000_000))
def test_a_wait_for_the_schedulers_port_is_quick_at_first_then_slower_and_bounded_by_the_job(
    waited_s: float, nodes: int
) -> None:
    """The first second of a wait tries every 10 ms (the scheduler found within milliseconds of
    listening), then every 100 ms; the job's nodes at most LISTEN_TRIES_PER_S times a second
    in all, whatever the wait."""
    every_s = listen_every_s(waited_s, nodes)
    pace = LISTEN_TRY_S if waited_s < LISTEN_FAST_S else LISTEN_SLOW_TRY_S
    assert every_s >= pace
    assert nodes / every_s <= LISTEN_TRIES_PER_S * (1 + 1e-9)  # (float division)
    assert every_s == pace or every_s == nodes / LISTEN_TRIES_PER_S
    # At that pace until the quick first second ends, then as long as the caller says.
    for_s = LISTEN_FAST_S - waited_s if waited_s < LISTEN_FAST_S else 3.0
    assert listen_pace(waited_s, nodes, 3.0) == (every_s, for_s)


@given(st.floats(0.0, 3600.0), st.integers(1, 1_000_000), st.lists(st.integers(0, 5000)))
def test_relays_and_direct_nodes_share_the_jobs_tries_whoever_speaks_for_whom(
    waited_s: float, nodes: int, speaks_for: list[int]
) -> None:
    """Each process tries the port as often as the nodes it speaks for would (a relay: the
    workers it serves; a node: itself; none counts as one), never slower than a node alone,
    so that however the job's nodes are spread over relays and direct connections, the tries
    above the pace's floor come to at most LISTEN_TRIES_PER_S a second."""
    pace = LISTEN_TRY_S if waited_s < LISTEN_FAST_S else LISTEN_SLOW_TRY_S
    above_floor = 0.0
    left = nodes
    for wanted in speaks_for:
        count = min(max(wanted, 1), left)
        if count == 0:
            break
        left -= count
        every_s = listen_every_s(waited_s, nodes, min(wanted, count))
        assert pace <= every_s <= listen_every_s(waited_s, nodes)
        if every_s > pace:
            above_floor += 1 / every_s
    assert above_floor <= LISTEN_TRIES_PER_S * (1 + 1e-9)  # (float division)
    assert listen_every_s(waited_s, nodes, 0) == listen_every_s(waited_s, nodes)
    assert listen_pace(waited_s, nodes, 3.0, 4)[0] == listen_every_s(waited_s, nodes, 4)


@given(st.integers(0, 2**64 - 1), st.floats(-5.0, 5.0), st.floats(0.0, 10.0))
def test_a_spread_draws_within_its_range_and_again_alike_from_its_seed(
    seed: int, low: float, width: float
) -> None:
    draws, again = Spread(seed), Spread(seed)
    drawn = [draws.uniform(low, low + width) for _ in range(20)]
    assert all(low <= x <= low + width for x in drawn)
    assert drawn == [again.uniform(low, low + width) for _ in range(20)]


def test_spreads_of_neighbouring_seeds_draw_unlike_numbers_evenly() -> None:
    """Processes seeded 1, 2, 3 (small incarnations, node ids) must not pause alike."""
    firsts = [Spread(seed).uniform(0.0, 1.0) for seed in range(1_000)]
    assert len(set(firsts)) == len(firsts)
    assert sum(x < 0.5 for x in firsts) == pytest.approx(500, abs=60)
    many = Spread(7)
    drawn = [many.uniform(0.0, 1.0) for _ in range(10_000)]
    assert sum(drawn) / len(drawn) == pytest.approx(0.5, abs=0.02)


@given(st.floats(1e-3, 100.0), st.integers(0, 2**32))
def test_a_jittered_pace_is_within_its_jitter(pace_s: float, seed: int) -> None:
    assert pace_s * (1 - JITTER) <= jittered(pace_s, Spread(seed)) <= pace_s * (1 + JITTER)


@given(st.integers(1, 1_000_000), st.integers(0, 2**32))
def test_a_guard_poll_hears_the_end_at_once_in_a_small_job_and_keeps_the_jobs_pace(
    nodes: int, seed: int
) -> None:
    """GUARD_POLL_S in a job of up to 750 nodes; beyond, longer: the job's nodes, pausing
    three quarters of the ceiling on average, ask about GUARD_TRIES_PER_S times a second."""
    ceiling = guard_poll_s(nodes)
    assert ceiling >= GUARD_POLL_S
    assert ceiling == GUARD_POLL_S or nodes > 750
    assert nodes / (ceiling * 0.75) <= GUARD_TRIES_PER_S * (1 + 1e-9)
    assert ceiling / 2 <= guard_pause_s(nodes, Spread(seed)) <= ceiling
