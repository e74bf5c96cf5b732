"""Whose Finish counted but whose answer was lost with its connection, pure: the members a
finished job still owes its end.

A member's Finish is counted (its node FINISHED) and answered once that is saved. A node that
hears the answer closes its stream after it; a node whose connection breaks in between (a
relay's host restarted, a network cut) never hears it: its worker holds its Finish and
registers again (`cluster.worker.machine.finishing`). If the job has ended meanwhile, the
scheduler's answer to that registration (the job finished, a refusal the worker takes as its
finish counted) is all that tells it; a scheduler that stopped would leave it waiting its whole
reconnect window and exiting 1, unable to know (on another host or with etcd, it cannot read
the saved state).

So the scheduler keeps, from the count to the answer (`unanswered`), the members whose answer
is on its way, and the ones whose stream closed meanwhile (`lost`, with when). A lost one is
owed the end until it hears it: its registration refused as the job finished, a stream of its
that opens again, or the job's end handed to its stream. A finished job waits for those
(`owed`), each at most MS_NODE_TIMEOUT after its stream closed: as long as the scheduler waits
for a silent node before it takes it for dead. Not saved (a restarted scheduler does not know),
like the guard's waiters.
"""

from __future__ import annotations

from dataclasses import field

from cluster.protocol.value import mutable


@mutable
class FinishAnswers:
    """Members whose Finish answer is on its way (`unanswered`) or was lost with their stream
    (`lost`: node id -> when its stream closed)."""

    unanswered: set[str] = field(default_factory=set)
    lost: dict[str, float] = field(default_factory=dict)

    def counted(self, node_id: str) -> None:
        """Its Finish counted (once more, for a Finish asked again): its answer is owed."""
        self.unanswered.add(node_id)
        self.lost.pop(node_id, None)

    def answered(self, node_id: str) -> None:
        """Its answer went, on a connection that was up when it went."""
        self.unanswered.discard(node_id)

    def closed(self, node_id: str, now: float) -> None:
        """Its stream closed: with its answer on the way, the answer is lost with it."""
        if node_id in self.unanswered:
            self.unanswered.discard(node_id)
            self.lost[node_id] = now

    def told(self, node_id: str) -> None:
        """It heard the job's end, or is back on a stream that will tell it."""
        self.unanswered.discard(node_id)
        self.lost.pop(node_id, None)

    def owed(self, now: float, wait_s: float) -> dict[str, float]:
        """The lost ones still worth waiting for: node id -> seconds left of `wait_s` from when
        its stream closed."""
        return {
            node_id: left
            for node_id, closed in self.lost.items()
            if (left := closed + wait_s - now) > 0
        }
