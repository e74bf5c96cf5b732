"""The members' bounds on the scheduler's loop (the rules: `machine.member_bounds`).

`MemberLimits.call` is around each member call (a collective, a key-value call, a checkpoint
report) once its first message came (before, the calls that wait for theirs are bounded by
address: `handlers.Arrivals`), and `request_bytes` counts the request as that message names
it: past the member's share of calls or of request bytes in flight the call is refused
(CapacityError: RESOURCE_EXHAUSTED), and what it sent is dropped.
`beat` drops a node's beats that come sooner than a fraction of the heartbeat interval after
the last one. `stream_open` refuses a node's Heartbeat stream opened faster than its rate
(CapacityError: RESOURCE_EXHAUSTED), answered after a hold. `ReportTurns` makes a member's
changing checkpoint reports wait for its turn. Each of them is counted by method and reason
(`counts`: the metrics' bounded labels), and the member is named in the scheduler's log at
most once a `refusals.INTERVAL_S` for each reason (the refusal limiter, keyed by the member
and the reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from cluster.protocol.config import canonical_node_id
from cluster.protocol.errors import CapacityError, ClusterError
from cluster.scheduler.machine.member_bounds import (
    OVER_OPENS,
    BeatGate,
    InFlight,
    OpenRate,
    Over,
    ReportPacer,
)
from cluster.scheduler.refusals import RefusalLimiter

log = logging.getLogger("cluster.scheduler")

# A node's beats are taken at most once per this fraction of the heartbeat interval (a real node
# beats once an interval).
BEAT_GAP = 0.25
# A member's checkpoint reports that change what it holds are saved at most once per this.
REPORT_EVERY_S = 0.1
# The reasons of `counts` beside the refusals of `InFlight` (a metric's label: bounded).
BEATS_DROPPED = "beats_dropped"
REPORTS_COALESCED = "reports_coalesced"

R = TypeVar("R")


class MemberLimits:
    def __init__(self, nodes: int, heartbeat_interval_s: float, clock: Callable[[], float]) -> None:
        self.in_flight = InFlight(nodes)
        self.beats: BeatGate[tuple[str, int]] = BeatGate(heartbeat_interval_s * BEAT_GAP)
        self.opens: OpenRate[str] = OpenRate()
        self._clock = clock
        self._told = RefusalLimiter(clock)

    @property
    def counts(self) -> dict[tuple[str, str], int]:
        """Calls refused, beats dropped, reports that waited: by (method, reason)."""
        return dict(self._told.counts)

    @contextlib.contextmanager
    def call(self, node_id: str, host: str, method: str) -> Iterator[None]:
        """Around a `method` call that says it is `node_id`'s, from `host`, once its first
        message came (the rest of a value may be on its way): CapacityError when the member is
        past its share of calls. Its request's bytes are counted as the first message names
        them (`request_bytes`). A member is counted by its node id and host: a call that names
        a node from elsewhere is not counted to it."""
        node = canonical_node_id(node_id)
        key = f"{node}@{host}"
        over = self.in_flight.open(key)
        if over is not None:
            raise self._refused(over, method, node, host)
        held = _Held(self, key, node, host, method)
        token = _HELD.set(held)
        try:
            yield
        finally:
            _HELD.reset(token)
            self.in_flight.close(key, held.size)

    def _refused(self, over: Over, method: str, node: str, host: str) -> CapacityError:
        error = over.error(method, f"node {node!r} (from {host})")
        self.tell(node, method, over.reason, str(error))
        return error

    def beat(self, node_id: str, incarnation: int) -> bool:
        """Whether to take a beat of the node now (False: dropped, counted)."""
        if self.beats.take((node_id, incarnation), self._clock()):
            return True
        self.tell(
            canonical_node_id(node_id),
            "Heartbeat",
            BEATS_DROPPED,
            f"it beats more often than once per {self.beats.gap_s:g} s; the extra beats are "
            "dropped (does one process of it open many Heartbeat streams?)",
        )
        return False

    async def stream_open(self, node_id: str, host: str) -> None:
        """An admitted Heartbeat stream of the node (from `host`) opens, to supersede the one it
        has: CapacityError when the node opens them faster than its rate (`OpenRate`), counted,
        naming the node, and raised once its hold is over; the node's open stream goes on."""
        node = canonical_node_id(node_id)
        too_often = self.opens.take(node, self._clock())
        if too_often is None:
            return
        error = too_often.error("Heartbeat", f"node {node!r} (from {host})")
        self.tell(node, "Heartbeat", OVER_OPENS, str(error))
        if too_often.hold_s > 0:
            try:
                await asyncio.sleep(too_often.hold_s)
            finally:
                self.opens.answered(node)
        raise error

    def tell(self, node_id: str, method: str, reason: str, message: str) -> None:
        """Count a bound `node_id` met; name it in the log at a bounded rate."""
        count = self._told.refused(f"node {node_id} ({reason})", method, reason)
        if count:
            since = f" ({count} times since last told)" if count > 1 else ""
            log.warning("node %r past its bounds (%s): %s%s", node_id, reason, message, since)


class _Held:
    """One member call in progress (`MemberLimits.call`): the bytes of its request."""

    def __init__(self, limits: MemberLimits, key: str, node: str, host: str, method: str):
        self.limits, self.key, self.node, self.host, self.method = limits, key, node, host, method
        self.size = 0

    def request(self, size: int) -> None:
        over = self.limits.in_flight.request(self.key, size)
        if over is not None:
            raise self.limits._refused(over, self.method, self.node, self.host)
        self.size += size


_HELD: contextvars.ContextVar[_Held | None] = contextvars.ContextVar("member_call", default=None)


def request_bytes(size: int) -> None:
    """The request of the member call in progress (`MemberLimits.call`, in this task) came,
    holding `size` bytes: CapacityError when its member is past its share of bytes."""
    held = _HELD.get()
    if held is not None:
        held.request(size)


class ReportTurns(Generic[R]):
    """Checkpoint reports waiting for their member's turn (`ReportPacer`), on the loop: at the
    turn, the newest that waited is taken (`take`), and every report that waited is answered
    after it. `take` raises the ClusterError of a report that cannot be taken (its node left)."""

    def __init__(
        self,
        limits: MemberLimits,
        take: Callable[[R], None],
        clock: Callable[[], float],
        every_s: float = REPORT_EVERY_S,
    ) -> None:
        self.pacer: ReportPacer[R] = ReportPacer(every_s)
        self._limits = limits
        self._take = take
        self._clock = clock
        self._turns: dict[str, asyncio.Future[None]] = {}

    async def turn(self, node_id: str, report: R, *, changes: bool) -> None:
        """Take `report` of the member `node_id` (canonical): now, or at its member's turn
        (then this returns once the newest report of the member is taken)."""
        now = self._clock()
        at = self.pacer.offer(node_id, report, changes=changes, now=now)
        if at is None:
            self._take(report)
            return
        every = self.pacer.every_s
        self._limits.tell(
            node_id,
            "ReportCheckpoints",
            REPORTS_COALESCED,
            f"its checkpoint reports change what it holds more often than once per {every:g} "
            "s; each waits for its turn, and only the newest is saved",
        )
        turn = self._turns.get(node_id)
        if turn is None:
            loop = asyncio.get_running_loop()
            turn = self._turns[node_id] = loop.create_future()
            loop.call_later(max(at - now, 0.0), self._due, node_id)
        await asyncio.shield(turn)

    def _due(self, node_id: str) -> None:
        turn = self._turns.pop(node_id)
        report = self.pacer.due(node_id, self._clock())
        try:
            if report is not None:
                self._take(report)
        except ClusterError as exc:
            turn.set_exception(exc)
            turn.exception()  # retrieved: every report that waited may have given up
            return
        turn.set_result(None)
