"""Finding the job's leader among its schedulers, pure: whom to ask next, and when to give up.

A client that knows several scheduler addresses asks one. The leader answers; a standby answers
with the leader it knows ("" while an election is under way); a scheduler that does not answer
is passed over. Two rules decide where to go next, and all three clients share them:

- `leader_to_follow`: the leader a standby names is asked next, unless it is the standby
  itself or one to pass over (asked already in this search, or found down a moment ago);
- `next_in_turn`: otherwise the next address of the configuration, round.

`LeaderSearch` is one pass over the addresses built on these rules, each asked at most once,
as `mscluster status` (`cluster.tools.status.fetch_any`) and `StatusClient` make it. The worker
core applies the same rules for as long as its registration deadline lasts, passing over a
leader found down within DOWN_FOR_S (`cluster.worker.machine.joining`). No clock and no I/O
here: the caller asks, and says what the answer was. `Upstream` applies them for a host's
relay, which sends every call of its workers to the one scheduler it takes for the leader
(`cluster.transport.relay`), and follows a named leader wherever it is, as the workers do.
"""

from __future__ import annotations

from collections.abc import Container, Sequence


def next_in_turn(addresses: Sequence[str], current: str) -> str:
    """The address after `current` in `addresses`, round; the first when `current` is none of
    them (a leader a standby named)."""
    if current not in addresses:
        return addresses[0]
    return addresses[(addresses.index(current) + 1) % len(addresses)]


def leader_to_follow(asked: str, leader: str, passed_over: Container[str]) -> str | None:
    """The leader that the standby at `asked` named, to be asked next; None when there is none
    to follow: none named, the standby itself named, or one in `passed_over`."""
    if not leader or leader == asked or leader in passed_over:
        return None
    return leader


class LeaderSearch:
    """One pass over `addresses` for the leader, from `first` (by default the first of them).

    Ask `next_address()`; when the scheduler there stands by, say whom it named with
    `standby(leader)`; one that does not answer needs no word. Every address is asked at most
    once: None from `next_address()` means every one was asked and none leads (give up). With
    `listed_only`, a named leader that is not one of `addresses` is not followed.
    """

    def __init__(
        self, addresses: Sequence[str], first: str | None = None, *, listed_only: bool = False
    ) -> None:
        self.addresses = tuple(addresses)
        self.listed_only = listed_only
        self.asked: list[str] = []  # in the order asked
        # The position in `addresses` of the next one in turn.
        self._turn = self.addresses.index(first) if first in self.addresses else 0
        self._named: str | None = None  # a leader to ask before the next in turn

    def next_address(self) -> str | None:
        """The address to ask now; None: every one was asked, give up."""
        named, self._named = self._named, None
        if named is not None:
            self.asked.append(named)
            return named
        count = len(self.addresses)
        for step in range(count):
            index = (self._turn + step) % count
            if self.addresses[index] not in self.asked:
                self._turn = index + 1
                self.asked.append(self.addresses[index])
                return self.addresses[index]
        return None

    def standby(self, leader: str) -> None:
        """The scheduler last asked stands by and named `leader` ("" for none)."""
        if not self.asked or (self.listed_only and leader not in self.addresses):
            return
        self._named = leader_to_follow(self.asked[-1], leader, self.asked)


# A leader named by a standby but found down this recently is not followed again yet (its lease
# has not ended: the standby still names it).
DOWN_FOR_S = 1.0


class Upstream:
    """Where a host's relay sends its workers' calls among the job's schedulers `addresses`, by
    the rules above, as the worker core applies them: the first to begin with; a leader that a
    standby names, unless it was found down within DOWN_FOR_S, wherever it is (one of
    `addresses` or not: a scheduler started since, or one that advertises another name than the
    list's, a pod's IP behind a DNS name), since the workers follow it too and their calls go
    through the relay; the next in turn when the one asked is found down, or a standby names
    no leader (the first of `addresses` after a leader named outside them). Only a scheduler
    the relay asked names a leader to it, as only one a worker asked names one to the worker.
    The caller says what came back from `asked` with the time `now`; a word about any other
    address than the current one is late (the relay moved already) and changes nothing. Each
    returns the new address, or None when the relay stays where it is."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.addresses = tuple(addresses)
        self.current = self.addresses[0]
        self._down: dict[str, float] = {}  # address -> when it was last found down

    def cut_off(self, asked: str, now: float) -> str | None:
        """A call to `asked` was cut off: the scheduler there, or the way to it, is down."""
        self._down[asked] = now
        if asked != self.current:
            return None
        return self._move(next_in_turn(self.addresses, asked))

    def found_down(self, address: str, now: float) -> None:
        """The scheduler at `address` was found down (not by a call the relay follows it for:
        it stays where it is); a standby naming it is not followed for DOWN_FOR_S."""
        self._down[address] = now

    def follows(self, asked: str, leader: str, now: float) -> bool:
        """Whether `not_leader(asked, leader, now)` would move to `leader`."""
        named = leader_to_follow(asked, leader, self._lately_down(now))
        return asked == self.current and named is not None and named != self.current

    def _lately_down(self, now: float) -> set[str]:
        return {a for a, when in self._down.items() if now - when < DOWN_FOR_S}

    def not_leader(self, asked: str, leader: str, now: float) -> str | None:
        """The scheduler at `asked` stands by and named `leader` ("" for none)."""
        if asked != self.current:
            return None
        named = leader_to_follow(asked, leader, self._lately_down(now))
        if named is not None:
            return self._move(named)
        if leader:
            return None  # a leader just found down, or itself: ask here again
        return self._move(next_in_turn(self.addresses, asked))

    def _move(self, address: str) -> str | None:
        if address == self.current:
            return None
        self.current = address
        return address
