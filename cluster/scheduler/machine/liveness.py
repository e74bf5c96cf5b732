"""Liveness, a part of the scheduler's state machine: how long a member has been silent, when
its silence reaches its limit, and when the machine must look at its members next.

A member's `last_seen` only moves forward (`seen`), so no member's silence can reach a limit
before `next_scan`: `SchedulerState.tick` looks at the members only then, not at every tick
(a pass over thousands of members ten times a second would be most of an idle scheduler's
work).

A node's heartbeats wait in gRPC's queue of calls behind the registrations that arrived before
them, and a large job's start is a burst of thousands: a live node's first beat was taken up
only after 30 s of them at 8,192 nodes. So a live node's silence counts at the earliest from
the last registration accepted in a burst (`silence`): while the job forms, or while a restored
job's nodes come back (`Registrar._in_burst`, which bounds both by MS_TOPO_TIMEOUT). A
registration at any other time (a spare's, a node's retry, a rejoin) is one call in the queue
and holds nobody's silence back, so no stream of them can hide a hung node: it is found
MS_NODE_TIMEOUT after its last beat, or after the burst.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import field

from cluster.protocol.records import Member, NodeState
from cluster.protocol.settings import JobSettings
from cluster.protocol.value import mutable

# A live process is heard every heartbeat interval: one heard within this many is live now.
LIVE_WITHIN_BEATS = 2


def silence_reason(silent_s: float) -> str:
    """Why a member silent for `silent_s` was failed, as its failure says. A worker's beats come
    from a Python thread, which cannot run while another holds the interpreter's lock: one
    long C call (a backtracking regex, a large pickle) silences a healthy worker too."""
    return (
        f"no heartbeat for {silent_s:.1f} s (hung, cut off, or holding Python's GIL in a long "
        "call: raise MS_NODE_TIMEOUT)"
    )


@mutable
class Liveness:
    settings: JobSettings
    # No member's silence can reach a limit before this time.
    next_scan: float = float("-inf")
    # When the scheduler last accepted a registration of a burst.
    last_accepted: float = float("-inf")
    # The members restored from a snapshot and not seen since: their `last_seen` is the restore.
    unheard: set[str] = field(default_factory=set)

    def seen(self, member: Member, now: float) -> None:
        """`member` was alive at `now` (its silence limit moves on, never back)."""
        member.last_seen = now
        self.unheard.discard(member.node_id)
        self.next_scan = min(self.next_scan, now + self.settings.silence_limit_s)

    def accepted(self, now: float) -> None:
        """A registration of a burst was accepted at `now`."""
        self.last_accepted = now

    def live_now(self, member: Member, now: float) -> bool:
        """Whether `member`'s process is live right now, as far as the scheduler can tell: its
        stream is open and it was heard within LIVE_WITHIN_BEATS heartbeat intervals. One that
        stopped (SIGSTOP, hung) is not once those have passed, nor one whose stream broke, nor
        one restored and not heard since; with MS_DISABLE_HEARTBEAT, one is only just after its
        stream opened."""
        return (
            member.state is NodeState.ALIVE
            and member.connected
            and member.node_id not in self.unheard
            and now - member.last_seen <= LIVE_WITHIN_BEATS * self.settings.heartbeat_interval_s
        )

    def silence(self, member: Member, now: float) -> float:
        """How long a live `member` has been silent, as far as it counts: not before the last
        registration accepted in a burst."""
        return now - max(member.last_seen, self.last_accepted)

    def due(self, member: Member) -> float:
        """When `member`'s silence would reach its limit in its present state."""
        settings = self.settings
        if member.state is NodeState.FAILED:
            return member.last_seen + settings.node_timeout_s + settings.topo_timeout_s
        if member.state is NodeState.ALIVE:
            return max(member.last_seen, self.last_accepted) + settings.silence_limit_s
        return float("inf")

    def scan_due(self, now: float) -> bool:
        """Whether a member's silence may have reached a limit by `now`; when it may, the next
        scan is found anew (`found`) while the members are looked at."""
        if now < self.next_scan:
            return False
        self.next_scan = float("inf")
        return True

    def found(self, when: float) -> None:
        """A member to look at again at `when` (found during a scan)."""
        self.next_scan = min(self.next_scan, when)

    def discount_stall(self, members: Iterable[Member], seconds: float, now: float) -> None:
        """The scheduler itself did not run for `seconds` (its process was stopped, or starved
        of CPU): it could not hear anyone meanwhile, so nobody's silence during it counts."""
        for member in members:
            member.last_seen = min(member.last_seen + seconds, now)
        self.next_scan = float("-inf")
