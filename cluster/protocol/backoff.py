"""Doubling delays between the attempts of something that keeps failing (a save, a call)."""

from __future__ import annotations

from dataclasses import field

from cluster.protocol.value import frozen, mutable


@mutable
class Backoff:
    """`first_s`, then twice as long each time, at most `max_s`; `reset()` after a success."""

    first_s: float
    max_s: float
    _next_s: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(
                f"backoff first_s={self.first_s} must be > 0 and <= max_s={self.max_s}"
            )
        self._next_s = self.first_s

    def next_s(self) -> float:
        """The delay before the next attempt (and the one after it doubles)."""
        delay = self._next_s
        self._next_s = min(delay * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self._next_s = self.first_s


@frozen
class RetryPolicy:
    """How something that keeps failing is tried again: after `first_s`, doubling up to
    `max_s` (a `Backoff` per run of failures)."""

    first_s: float
    max_s: float

    def __post_init__(self) -> None:
        self.backoff()  # ValueError for delays that could not wait

    def backoff(self) -> Backoff:
        return Backoff(self.first_s, self.max_s)
