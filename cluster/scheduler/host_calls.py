"""The host calls open now: a relay's `HostBeats` and `HostWatch` streams, by peer address and
connection.

Such a call carries no proof of its own. It speaks for the nodes whose admitted Watch streams are
on its connection (its beats count only for them, its attaches are each admitted as the Watch
call they stand for); a call on a connection that carries none speaks for nobody, and an outsider
could hold such calls without end, each with its buffers. So from one address at most `per_peer`
of them are open at once, however many connections they come on; past that a new one is turned
away. A call on a member's connection is never turned away, and an open call is ended here only
when the scheduler stops (a relay's streams are quiet while its workers are).

A relay's calls last as long as the relay, past the end of the job: the scheduler that stops
ends them first (`end`), each by the way its handler returns, so that its server stops with no
handler of theirs left to cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Mapping


class HostCalls:
    """The open host calls; `members`: the admitted Watch streams on each connection (the
    servicer's `member_peers`, read at each new call)."""

    def __init__(self, per_peer: int, members: Mapping[str, int]) -> None:
        self.per_peer = per_peer
        self._members = members
        self._open: dict[str, Counter[str]] = {}
        self._ends: set[Callable[[], None]] = set()  # how each open call is ended
        self._none_open = asyncio.Event()
        self._none_open.set()
        self.ending = False  # set by `end`: a call opened from now on is ended at once

    @property
    def held(self) -> int:
        """Host calls open now, a member's or not."""
        return sum(calls.total() for calls in self._open.values())

    def memberless(self, address: str) -> int:
        """Open host calls from `address` whose connection carries no admitted Watch stream."""
        calls = self._open.get(address, Counter())
        return sum(n for connection, n in calls.items() if not self._members.get(connection))

    def open(self, address: str, connection: str, end: Callable[[], None]) -> bool:
        """Count a new call from `address` on `connection`, which `end()` makes its handler
        return (called at once when the host calls are ending); False (nothing counted): turned
        away, as `address` holds `per_peer` calls that speak for nobody already."""
        if not self._members.get(connection) and self.memberless(address) >= self.per_peer:
            return False
        self._open.setdefault(address, Counter())[connection] += 1
        self._ends.add(end)
        self._none_open.clear()
        if self.ending:
            end()
        return True

    def close(self, address: str, connection: str, end: Callable[[], None]) -> None:
        """The call `open` counted (with `end`) has ended."""
        calls = self._open[address]
        calls[connection] -= 1
        if calls[connection] <= 0:
            del calls[connection]
            if not calls:
                del self._open[address]
        self._ends.discard(end)
        if not self._open:
            self._none_open.set()

    async def end(self, wait_s: float) -> bool:
        """The scheduler stops: end every open call, and every call opened from now on at once;
        True when none is open within `wait_s`."""
        self.ending = True
        for end in list(self._ends):
            end()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._none_open.wait(), wait_s)
        return not self._open
