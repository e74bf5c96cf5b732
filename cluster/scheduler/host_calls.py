"""The host calls open now: a relay's `HostBeats` and `HostWatch` streams, by peer address and
connection.

Such a call carries no proof of its own. It speaks for the nodes whose admitted Watch streams are
on its connection (its beats count only for them, its attaches are each admitted as the Watch
call they stand for); a call on a connection that carries none speaks for nobody, and an outsider
could hold such calls without end, each with its buffers. So from one address at most `per_peer`
of them are open at once, however many connections they come on; past that a new one is turned
away. A call on a member's connection is never turned away, and an open call is never ended here
(a relay's streams are quiet while its workers are).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping


class HostCalls:
    """The open host calls; `members`: the admitted Watch streams on each connection (the
    servicer's `member_peers`, read at each new call)."""

    def __init__(self, per_peer: int, members: Mapping[str, int]) -> None:
        self.per_peer = per_peer
        self._members = members
        self._open: dict[str, Counter[str]] = {}

    @property
    def held(self) -> int:
        """Host calls open now, a member's or not."""
        return sum(calls.total() for calls in self._open.values())

    def memberless(self, address: str) -> int:
        """Open host calls from `address` whose connection carries no admitted Watch stream."""
        calls = self._open.get(address, Counter())
        return sum(n for connection, n in calls.items() if not self._members.get(connection))

    def open(self, address: str, connection: str) -> bool:
        """Count a new call from `address` on `connection`; False (nothing counted): turned away,
        as `address` holds `per_peer` calls that speak for nobody already."""
        if not self._members.get(connection) and self.memberless(address) >= self.per_peer:
            return False
        self._open.setdefault(address, Counter())[connection] += 1
        return True

    def close(self, address: str, connection: str) -> None:
        """The call `open` counted has ended."""
        calls = self._open[address]
        calls[connection] -= 1
        if calls[connection] <= 0:
            del calls[connection]
            if not calls:
                del self._open[address]
