"""cluster.protocol.backoff: the delays between attempts that keep failing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.backoff import (
    LISTEN_FAST_S,
    LISTEN_SLOW_TRY_S,
    LISTEN_TRIES_PER_S,
    LISTEN_TRY_S,
    Backoff,
    listen_every_s,
    listen_pace,
)


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
