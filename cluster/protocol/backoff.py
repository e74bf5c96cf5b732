"""Delays between the attempts of something that keeps failing: doubling ones (a save, a call),
the pace at which a node tries the port of a scheduler that is not listening (yet), and how
often a node refused by the guard asks again; and the jitter that keeps the job's nodes, which
wait together (they start together; a scheduler's restart finds every one of them waiting),
from trying together."""

from __future__ import annotations

from dataclasses import field
from typing import Protocol

from cluster.protocol.records import GUARD_POLL_S
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


# While the scheduler's port refuses connections (not listening yet, or restarting), a node that
# connects to it directly (and a host's relay, for its workers) tries it every LISTEN_TRY_S for
# the first LISTEN_FAST_S of its wait (the job's processes start together: the scheduler is found
# within milliseconds of listening), then every LISTEN_SLOW_TRY_S (gRPC's own floor: a scheduler
# that is late costs each waiting process about 0.2% of a core, not 2-4%); and the job's nodes at
# most about LISTEN_TRIES_PER_S times a second in all (a refused connection costs the
# scheduler's host one packet back): each node its share, a relay the shares of the workers it
# waits for.
LISTEN_TRY_S, LISTEN_FAST_S, LISTEN_SLOW_TRY_S = 0.01, 1.0, 0.1
LISTEN_TRIES_PER_S = 10_000


def listen_every_s(waited_s: float, nodes: int, speaks_for: int = 1) -> float:
    """How long apart a process `waited_s` into its wait for the scheduler's port tries it, in
    a job of `nodes` nodes, trying for `speaks_for` of them (a relay: the workers it serves).
    Processes that speak for at most `nodes` in all try at most LISTEN_TRIES_PER_S times a
    second together."""
    pace = LISTEN_TRY_S if waited_s < LISTEN_FAST_S else LISTEN_SLOW_TRY_S
    return max(pace, nodes / (LISTEN_TRIES_PER_S * max(speaks_for, 1)))


def listen_pace(
    waited_s: float, nodes: int, slow_for_s: float, speaks_for: int = 1
) -> tuple[float, float]:
    """(every_s, for_s) of a wait for the scheduler's port `waited_s` in: how long apart to try
    it (`listen_every_s`), and for how long at that pace before the caller looks again: to the
    end of the quick first second, then `slow_for_s`."""
    fast_left_s = LISTEN_FAST_S - waited_s
    every_s = listen_every_s(waited_s, nodes, speaks_for)
    return every_s, fast_left_s if fast_left_s > 0 else slow_for_s


# Each pause of a wait that the job's nodes make together is drawn within JITTER of its pace (a
# pace is kept on average), so that tries that would arrive in bursts of N spread out.
JITTER = 0.25
# A node refused by the guard asks again after a pause drawn between half of its ceiling and the
# ceiling (`guard_poll_s`): GUARD_POLL_S, so that it hears at once that the job ended; in a job
# of more than 750 nodes, longer, so that the job's nodes ask about GUARD_TRIES_PER_S times a
# second in all (a registration is a call the scheduler answers, not a refused connection).
GUARD_TRIES_PER_S = 1_000
_GUARD_LEAST = 0.5  # the shortest pause, of the ceiling
_MASK64 = (1 << 64) - 1


class Draws(Protocol):
    """Where jitter is drawn from: `random.Random` is one, `Spread` another. The pure cores
    take one, seeded by their shell, so that they stay deterministic under test."""

    def uniform(self, a: float, b: float) -> float: ...


class Spread:
    """Draws from `seed` (SplitMix64: 64 bits of state, well mixed from any seed, so that
    processes seeded 1, 2, 3 draw unlike numbers). Not `random.Random`: a worker imports no
    `random` (it costs every process its import)."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def uniform(self, a: float, b: float) -> float:
        """A number between `a` and `b`, as `random.Random.uniform` draws one."""
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        return a + (b - a) * ((z >> 11) / float(1 << 53))


def jittered(pace_s: float, draws: Draws) -> float:
    """`pace_s`, give or take JITTER of it."""
    return pace_s * draws.uniform(1 - JITTER, 1 + JITTER)


def guard_poll_s(nodes: int) -> float:
    """The longest a node refused by the guard waits before it asks again, in a job of `nodes`:
    GUARD_POLL_S, or its share of GUARD_TRIES_PER_S (its pauses average three quarters of
    this). Once the job ends, the scheduler waits this long, and GUARD_POLL_MARGIN_S more, for
    the nodes it refused lately to ask again and hear it."""
    return max(GUARD_POLL_S, nodes / (GUARD_TRIES_PER_S * (1 + _GUARD_LEAST) / 2))


def guard_pause_s(nodes: int, draws: Draws) -> float:
    """A pause of a node waiting out the guard: between half of `guard_poll_s` and all of it."""
    return guard_poll_s(nodes) * draws.uniform(_GUARD_LEAST, 1.0)
