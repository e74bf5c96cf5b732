"""What one member may make the scheduler hold or do, as pure rules: its calls in flight, its
beats, its Heartbeat stream opens, its checkpoint reports' saves.

Every member's calls are admitted (its credential), but an admitted member can still run away:
128 threads setting 2 MiB values held 1.2 GB at the scheduler and slowed every other rank's
barrier to a second; 32 Heartbeat streams beating as fast as they could took most of a core;
checkpoint reports that change at every call made the saver write thousands of times a minute;
four loops of one member, each opening a Heartbeat stream again as soon as another's superseded
it, had the scheduler set up and supersede over 1,000 streams a second. So each member has its
share, and past it the scheduler refuses, or drops, or waits, for that member only:

- `InFlight`: a member's open calls (from their start, while the request is on its way) and
  the bytes of their requests that the scheduler holds, each bounded by the member's share of
  a total (the total over the job's nodes, never less than a floor; the KV shares' rule,
  `machine.kv`). A call past either is refused with a CapacityError that names the member,
  its share and what to do. A member's only request is taken whatever its size (the edge caps
  each message).
- `BeatGate`: a node's beats are taken at most once per `gap_s` (a fraction of the heartbeat
  interval, so no real beat is dropped); the others are dropped and counted.
- `OpenRate`: a node's Heartbeat streams are opened at most `burst` at once, then one per
  `every_s` (a token bucket). A real worker opens one when it joins and one after each lost
  connection or change of scheduler or relay: a few a minute, far under the rate, and a new
  scheduler (restarted, or a standby that took over) starts every node's bucket full. An open
  past the rate is refused (`TooOften`: a CapacityError that names the node, the rate and what
  to do) and takes nothing: the node's open stream goes on. Its refusal is answered after
  `hold_s` (at most `holds` held per node; past them, at once): a member that opens again as
  soon as it is answered opens once a hold, not as fast as the network goes.
- `ReportPacer`: a checkpoint report that changes what the member holds is taken at most once
  per `every_s` per member; one that comes sooner waits for its member's next turn, and the
  newest waiting one is the one taken then (a worker's report names every step it holds). A
  report that changes nothing is taken at once.

Keys name members (a relay carries many members on one connection: the count is per member,
not per connection).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Generic, TypeVar

from cluster.protocol.errors import CapacityError
from cluster.protocol.value import frozen

MIB = 1024 * 1024
# The calls and request bytes all members may have in flight at the scheduler, shared among the
# job's nodes; each member has at least the floor (a rank's few threads, its 16 key waits).
CALLS_TOTAL = 128
CALLS_FLOOR = 32
BYTES_TOTAL = 128 * MIB
BYTES_FLOOR = 16 * MIB
# The reasons a member's call is refused (a metric's label: bounded).
OVER_CALLS = "member_calls"
OVER_BYTES = "member_bytes"
# A node's Heartbeat stream opens: this many at once, then one per OPEN_EVERY_S (12 a minute);
# a refused open is answered after OPEN_HOLD_S, at most OPEN_HOLDS of a node held at once.
OPENS_BURST = 16
OPEN_EVERY_S = 5.0
OPEN_HOLD_S = 1.0
OPEN_HOLDS = 16
# The reason a Heartbeat stream open is refused (a metric's label: bounded).
OVER_OPENS = "stream_opens"


def share(total: int, nodes: int, floor: int) -> int:
    """A member's share of `total` in a job of `nodes`: the total over the nodes, at least
    `floor` (so at most the floor times the nodes in all)."""
    return max(total // max(nodes, 1), floor)


@frozen
class Over:
    """A call refused: its member is past its share (`reason`: OVER_CALLS or OVER_BYTES)."""

    reason: str
    calls: int
    held: int
    call_share: int
    byte_share: int

    def error(self, method: str, who: str) -> CapacityError:
        """The refusal of a `method` call of `who` (the member, named)."""
        return CapacityError(
            f"a {method} call of {who} refused: it has {self.calls} calls open at the "
            f"scheduler holding {self.held:,} bytes of requests, and a member's share is "
            f"{self.call_share} calls and {self.byte_share:,} bytes (the scheduler's total "
            "over the job's nodes); wait for its calls to be answered before making more "
            "(fewer threads calling the store or collectives at once)"
        )


class InFlight:
    """Each member's open calls (from their start: a request on its way is held too) and the
    bytes of their requests (once they came), within its shares."""

    def __init__(
        self, nodes: int, *, calls_total: int = CALLS_TOTAL, bytes_total: int = BYTES_TOTAL
    ) -> None:
        self.call_share = share(calls_total, nodes, CALLS_FLOOR)
        self.byte_share = share(bytes_total, nodes, BYTES_FLOOR)
        # A member with nothing in flight has no entry: ids that come and go leave nothing.
        self._calls: collections.Counter[str] = collections.Counter()
        self._bytes: collections.Counter[str] = collections.Counter()

    def open(self, key: str) -> Over | None:
        """Count a call of `key` that starts; what it is past (None: counted)."""
        calls = self._calls[key]
        if calls >= self.call_share:
            return self._over(OVER_CALLS, key)
        self._calls[key] = calls + 1
        return None

    def request(self, key: str, size: int) -> Over | None:
        """The request of an open call of `key` came, `size` bytes; what it is past (None:
        counted). A member's only request holding bytes is taken whatever its size."""
        held = self._bytes[key]
        if held and held + size > self.byte_share:
            return self._over(OVER_BYTES, key)
        if size:
            self._bytes[key] = held + size
        return None

    def close(self, key: str, size: int) -> None:
        """An open call of `key` ended; `size`: the bytes `request` counted of it (0: none)."""
        calls = self._calls[key] - 1
        if calls <= 0:
            self._calls.pop(key, None)
        else:
            self._calls[key] = calls
        held = self._bytes[key] - size
        if held <= 0:
            self._bytes.pop(key, None)
        else:
            self._bytes[key] = held

    def held(self, key: str) -> tuple[int, int]:
        """The calls and bytes `key` has in flight."""
        return self._calls.get(key, 0), self._bytes.get(key, 0)

    def _over(self, reason: str, key: str) -> Over:
        calls, held = self.held(key)
        return Over(reason, calls, held, self.call_share, self.byte_share)


K = TypeVar("K", bound=Hashable)


class BeatGate(Generic[K]):
    """Takes a key's beats at most once per `gap_s`."""

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s
        self._last: dict[K, float] = {}
        self._prune_at = 64
        self.dropped = 0

    def take(self, key: K, now: float) -> bool:
        """Whether to take a beat of `key` at `now` (False: dropped, counted)."""
        last = self._last.get(key)
        if last is not None and now - last < self.gap_s:
            self.dropped += 1
            return False
        self._last[key] = now
        if len(self._last) > self._prune_at:
            # Keys whose last beat is a gap old would be taken anyway: forgotten, so keys that
            # come and go (restarted processes) leave nothing behind.
            self._last = {k: t for k, t in self._last.items() if now - t < self.gap_s}
            self._prune_at = 2 * len(self._last) + 64
        return True


@frozen
class TooOften:
    """A stream open refused: its node opens them faster than `burst` at once and one per
    `every_s`; one is taken again in `wait_s`. The refusal is answered after `hold_s` (0: at
    once), and then `OpenRate.answered`."""

    burst: int
    every_s: float
    wait_s: float
    hold_s: float

    def error(self, method: str, who: str) -> CapacityError:
        """The refusal of a `method` stream of `who` (the node, named)."""
        return CapacityError(
            f"a {method} stream of {who} refused: it opens {method} streams faster than "
            f"{self.burst} at once and then one per {self.every_s:g} s (a real worker opens one "
            "when it joins and after a lost connection or a change of scheduler: a few a "
            "minute); the stream it has open goes on. Open a new one only once the last has "
            "ended, at most once a heartbeat interval, and look for what in that process "
            f"opens them in a loop; the next is taken in {self.wait_s:.1f} s"
        )


class OpenRate(Generic[K]):
    """Takes a key's opens at most `burst` at once, then one per `every_s`: a token bucket,
    kept as the time each key's bucket is full again (a key with a full bucket has no entry).
    A refused open takes nothing; its answer is held `hold_s` (at most the wait for the next),
    `holds` of a key at once."""

    def __init__(
        self,
        burst: int = OPENS_BURST,
        every_s: float = OPEN_EVERY_S,
        *,
        hold_s: float = OPEN_HOLD_S,
        holds: int = OPEN_HOLDS,
    ) -> None:
        self.burst, self.every_s = burst, every_s
        self.hold_s, self.holds = hold_s, holds
        self._full_at: dict[K, float] = {}
        self._prune_at = 64
        self._held: collections.Counter[K] = collections.Counter()
        self.refused = 0

    def take(self, key: K, now: float) -> TooOften | None:
        """Take an open of `key` at `now` (None); else it is refused, counted, and the answer
        says when the next would be taken and how long to hold the refusal (then `answered`)."""
        full_at = max(self._full_at.get(key, now), now)
        ahead = full_at - now - (self.burst - 1) * self.every_s
        if ahead > 0:
            self.refused += 1
            hold = min(ahead, self.hold_s) if self._held[key] < self.holds else 0.0
            if hold > 0:
                self._held[key] += 1
            return TooOften(self.burst, self.every_s, ahead, hold)
        self._full_at[key] = full_at + self.every_s
        if len(self._full_at) > self._prune_at:
            # A key whose bucket is full again is as one never seen: forgotten, so keys that
            # come and go leave nothing behind.
            self._full_at = {k: t for k, t in self._full_at.items() if t > now}
            self._prune_at = 2 * len(self._full_at) + 64
        return None

    def answered(self, key: K) -> None:
        """A refusal of `key` held (`TooOften.hold_s` > 0) was answered."""
        held = self._held[key] - 1
        if held <= 0:
            self._held.pop(key, None)
        else:
            self._held[key] = held

    def holding(self, key: K) -> int:
        """The refusals of `key` held now."""
        return self._held.get(key, 0)


R = TypeVar("R")


class ReportPacer(Generic[R]):
    """Each member's changing checkpoint reports, taken at most once per `every_s`."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._taken: dict[str, float] = {}  # when each member's last changing report was taken
        self._waiting: dict[str, R] = {}  # each member's newest report waiting for its turn
        self.coalesced = 0  # reports overtaken by a newer one before their turn

    def offer(self, node_id: str, report: R, *, changes: bool, now: float) -> float | None:
        """A report of `node_id`: None when it is taken now; else when its member's turn comes
        (it waits, and overtakes the one that waited). A report that changes nothing is taken
        at once, unless one waits (then it is the newest, and waits in its place)."""
        waiting = node_id in self._waiting
        last = self._taken.get(node_id)
        if not waiting and (not changes or last is None or now - last >= self.every_s):
            if changes:
                self._taken[node_id] = now
            return None
        if waiting:
            self.coalesced += 1
        self._waiting[node_id] = report
        return (last if last is not None else now) + self.every_s

    def due(self, node_id: str, now: float) -> R | None:
        """`node_id`'s turn: the report that waited for it, to take now (None: none waits)."""
        report = self._waiting.pop(node_id, None)
        if report is not None:
            self._taken[node_id] = now
        return report
