"""cluster.protocol.backoff: the delays between attempts that keep failing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.backoff import Backoff


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
